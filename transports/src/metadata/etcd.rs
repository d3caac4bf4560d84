//! An etcd v3 store, through etcd's JSON gateway (`POST /v3/kv/range|put|deleterange|txn`,
//! `/v3/lease/*`; keys and values base64 in JSON).
//!
//! Why the gateway and not gRPC: it ships in every etcd v3 server (3.4 and later), needs no
//! protobuf code generation or tonic/prost build, and reuses the small HTTP client the HTTP
//! store already has; the store does a handful of calls per engine lifetime, so gRPC's speed
//! buys nothing here.
//!
//! A descriptor is put under a lease when the store has a TTL: an engine that dies without
//! removing its entry loses it when the lease expires, so a departed peer's descriptor does
//! not outlive it. Publishing is a transaction "create if absent", so two live engines never
//! share a name; removal is a transaction on the entry's revision, after checking it is still
//! the caller's instance.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::MetadataStore;
use super::http::{HttpUrl, KEY_PREFIX, decode_entry, duplicate, request};
use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::BoxFuture;

fn metadata_err(detail: impl Into<String>) -> Error {
    Error::new(ErrorKind::Metadata, detail)
}

/// A store in an etcd v3 cluster (one endpoint).
#[derive(Debug)]
pub struct EtcdStore {
    url: HttpUrl,
    timeout: Duration,
    ttl: Option<Duration>,
    /// The lease this store's entries live under (granted on first publish) and the task
    /// keeping it alive.
    lease: tokio::sync::Mutex<Option<i64>>,
    stop: CancellationToken,
    keepalive_error: Arc<Mutex<Option<String>>>,
}

impl EtcdStore {
    /// `url`: an etcd client URL, `http://host:2379`. `ttl`: lease time of published entries
    /// (None: entries stay until removed).
    pub fn new(url: &str, ttl: Option<Duration>) -> Result<Arc<Self>> {
        let url = HttpUrl::parse(url)?;
        if let Some(t) = ttl
            && t < Duration::from_secs(2)
        {
            return Err(Error::new(
                ErrorKind::Resource,
                format!("etcd lease TTL {t:?} is under the 2 s etcd accepts"),
            ));
        }
        Ok(Arc::new(Self {
            url,
            timeout: Duration::from_secs(5),
            ttl,
            lease: tokio::sync::Mutex::new(None),
            stop: CancellationToken::new(),
            keepalive_error: Arc::new(Mutex::new(None)),
        }))
    }

    async fn call(&self, path: &str, body: serde_json::Value) -> Result<serde_json::Value> {
        call(&self.url, self.timeout, path, body).await
    }

    /// The entry under `key`: its value and modification revision.
    async fn range(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>> {
        let r = self
            .call("/v3/kv/range", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        let r: RangeReply = parse(&r, "/v3/kv/range")?;
        first_kv(r.kvs)
    }

    async fn lease_id(&self) -> Result<Option<i64>> {
        let Some(ttl) = self.ttl else {
            return Ok(None);
        };
        let mut lease = self.lease.lock().await;
        if let Some(id) = *lease {
            return Ok(Some(id));
        }
        let r = self
            .call(
                "/v3/lease/grant",
                json!({ "TTL": ttl.as_secs().to_string() }),
            )
            .await?;
        let g: GrantReply = parse(&r, "/v3/lease/grant")?;
        let id: i64 =
            g.id.as_deref()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| metadata_err(format!("etcd lease grant returned no ID: {r}")))?;
        *lease = Some(id);
        let (url, timeout, stop, err) = (
            self.url.clone(),
            self.timeout,
            self.stop.clone(),
            self.keepalive_error.clone(),
        );
        tokio::spawn(async move {
            let every = ttl / 3;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                let r = call(
                    &url,
                    timeout,
                    "/v3/lease/keepalive",
                    json!({ "ID": id.to_string() }),
                )
                .await;
                if let Err(e) = r {
                    warn!(error = %e, lease = id, "etcd lease keepalive failed");
                    *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
            }
        });
        Ok(Some(id))
    }

    fn where_(&self) -> String {
        format!("etcd at http://{}", self.url.authority)
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn call(
    url: &HttpUrl,
    timeout: Duration,
    path: &str,
    body: serde_json::Value,
) -> Result<serde_json::Value> {
    let body = serde_json::to_vec(&body).expect("json encodes");
    let (status, reply) = request(
        &url.authority,
        "POST",
        path,
        Some("application/json"),
        &body,
        timeout,
    )
    .await?;
    let text = || String::from_utf8_lossy(&reply[..reply.len().min(300)]).into_owned();
    if status != 200 {
        return Err(metadata_err(format!(
            "etcd {path} at http://{}: status {status}: {}",
            url.authority,
            text()
        )));
    }
    // The keepalive stream wraps its reply as {"result": ...}; take the first JSON value.
    let mut de = serde_json::Deserializer::from_slice(&reply).into_iter::<serde_json::Value>();
    match de.next() {
        Some(Ok(v)) => Ok(v),
        _ => Err(metadata_err(format!(
            "etcd {path}: reply is not JSON: {}",
            text()
        ))),
    }
}

fn parse<T: for<'de> Deserialize<'de>>(v: &serde_json::Value, what: &str) -> Result<T> {
    T::deserialize(v).map_err(|e| metadata_err(format!("etcd {what}: unexpected reply: {e}")))
}

#[derive(Deserialize)]
struct Kv {
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    mod_revision: Option<String>,
}

#[derive(Deserialize)]
struct RangeReply {
    #[serde(default)]
    kvs: Vec<Kv>,
}

#[derive(Deserialize)]
struct GrantReply {
    #[serde(rename = "ID")]
    id: Option<String>,
}

#[derive(Deserialize)]
struct TxnReply {
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<serde_json::Value>,
}

fn first_kv(kvs: Vec<Kv>) -> Result<Option<(Vec<u8>, i64)>> {
    let Some(kv) = kvs.into_iter().next() else {
        return Ok(None);
    };
    let value = unb64(kv.value.as_deref().unwrap_or(""))
        .ok_or_else(|| metadata_err("etcd returned a value that is not base64"))?;
    let rev = kv
        .mod_revision
        .as_deref()
        .unwrap_or("0")
        .parse()
        .map_err(|_| metadata_err("etcd returned a non-numeric mod_revision"))?;
    Ok(Some((value, rev)))
}

impl MetadataStore for EtcdStore {
    fn publish(&self, desc: SegmentDescriptor) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            desc.validate()?;
            let key = format!("{KEY_PREFIX}{}", desc.name);
            let lease = self.lease_id().await?;
            let mut put = json!({ "key": b64(key.as_bytes()), "value": b64(&desc.to_bytes()) });
            if let Some(id) = lease {
                put["lease"] = json!(id.to_string());
            }
            // Create if absent; otherwise read what is there in the same transaction.
            let r = self
                .call(
                    "/v3/kv/txn",
                    json!({
                        "compare": [{ "key": b64(key.as_bytes()), "target": "CREATE",
                                      "result": "EQUAL", "create_revision": "0" }],
                        "success": [{ "request_put": put }],
                        "failure": [{ "request_range": { "key": b64(key.as_bytes()) } }],
                    }),
                )
                .await?;
            let t: TxnReply = parse(&r, "/v3/kv/txn")?;
            if t.succeeded {
                return Ok(());
            }
            let existing = t
                .responses
                .first()
                .and_then(|r| r.get("response_range"))
                .map(|r| parse::<RangeReply>(r, "/v3/kv/txn range"))
                .transpose()?
                .map(|r| first_kv(r.kvs))
                .transpose()?
                .flatten();
            if let Some((bytes, _)) = existing
                && let Ok(old) = decode_entry(&key, &desc.name, &bytes)
                && old.instance != desc.instance
            {
                return Err(duplicate(&desc.name, old.instance, &self.where_()));
            }
            // Ours (a republish) or an undecodable leftover: replace it.
            self.call("/v3/kv/put", put).await?;
            Ok(())
        })
    }

    fn lookup(&self, name: &str) -> BoxFuture<'_, Result<Option<SegmentDescriptor>>> {
        let name = name.to_owned();
        Box::pin(async move {
            let key = format!("{KEY_PREFIX}{name}");
            match self.range(&key).await? {
                None => Ok(None),
                Some((bytes, _)) => decode_entry(&key, &name, &bytes).map(Some),
            }
        })
    }

    fn remove(&self, name: &str, instance: u64) -> BoxFuture<'_, Result<()>> {
        let name = name.to_owned();
        Box::pin(async move {
            let key = format!("{KEY_PREFIX}{name}");
            let Some((bytes, rev)) = self.range(&key).await? else {
                return Ok(());
            };
            if decode_entry(&key, &name, &bytes).is_ok_and(|d| d.instance != instance) {
                return Ok(()); // a newer engine's entry
            }
            // Delete only the revision just checked: a concurrent republish survives.
            self.call(
                "/v3/kv/txn",
                json!({
                    "compare": [{ "key": b64(key.as_bytes()), "target": "MOD",
                                  "result": "EQUAL", "mod_revision": rev.to_string() }],
                    "success": [{ "request_delete_range": { "key": b64(key.as_bytes()) } }],
                }),
            )
            .await?;
            Ok(())
        })
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (what etcd's JSON gateway uses for bytes).
pub(crate) fn b64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); None on any other character.
pub(crate) fn unb64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for b in s.bytes() {
        let v = B64.iter().position(|&x| x == b)? as u32;
        acc = acc << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    (bits < 6).then_some(out)
}
