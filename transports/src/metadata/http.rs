//! Mooncake's HTTP metadata protocol, both sides: a client store ([`HttpStore`]) and a server
//! ([`MetadataServer`], behind `omnirig metadata-server`).
//!
//! The protocol (as Mooncake's `mooncake_http_metadata_server` speaks it): one resource,
//! `/metadata?key=K`. `GET` answers 200 with the stored value as the raw body, or 404 when
//! the key is absent; `PUT` stores the raw request body under the key (overwriting) and
//! answers 200; `DELETE` removes the key and answers 200 whether or not it existed. There is
//! no compare-and-set, so "refuse a second live engine under one name" is a read-then-write
//! here, and removal checks the owner's instance before deleting.
//!
//! The HTTP/1.1 is hand-written on tokio (one request per connection, `Connection: close`)
//! so the engine takes no HTTP dependency; every length read off the network is bounded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::MetadataStore;
use crate::error::{Error, ErrorKind, Result};
use crate::segment::{MAX_ENCODED_DESCRIPTOR, SegmentDescriptor};
use crate::transport::BoxFuture;

/// Longest request or status line plus headers accepted, either side.
const MAX_HEAD: usize = 16 << 10;
/// Longest body accepted, either side: a descriptor at its limit, plus room for an etcd
/// gateway's JSON and base64 around one.
pub(crate) const MAX_BODY: usize = MAX_ENCODED_DESCRIPTOR * 2 + (64 << 10);
/// Longest key the server stores.
const MAX_KEY: usize = 1024;
/// Most keys the server holds; a PUT beyond that is refused (507), not an unbounded map.
const MAX_KEYS: usize = 1 << 16;
/// Where omnirig keeps segment descriptors in a shared store, apart from Mooncake's own keys.
pub const KEY_PREFIX: &str = "omnirig/segment/";

fn metadata_err(detail: impl Into<String>) -> Error {
    Error::new(ErrorKind::Metadata, detail)
}

/// An `http://host:port[/path]` URL, split. Only plain HTTP (the stores run inside a cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    /// `host:port`, as dialed and as sent in `Host:`.
    pub authority: String,
    /// The path, starting with `/`.
    pub path: String,
}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::new(
                ErrorKind::Resource,
                format!("metadata URL {url:?}: {why} (expected http://host:port[/path])"),
            )
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("only http:// is supported"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad("bad host or port"));
        }
        if path.contains(['?', '#', ' ']) {
            return Err(bad("the path may not carry a query"));
        }
        Ok(Self {
            authority: authority.to_owned(),
            path: path.to_owned(),
        })
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
pub(crate) fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn decode_query(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// A parsed response or request head.
struct Head {
    /// Request: "GET /x HTTP/1.1"; response: "HTTP/1.1 200 OK".
    first: String,
    headers: Vec<(String, String)>,
    /// Bytes read past the head (the start of the body).
    rest: Vec<u8>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

async fn read_head<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<Head>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Err(invalid(format!("HTTP head longer than {MAX_HEAD} bytes")));
        }
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(invalid("connection closed inside the HTTP head".into()))
            };
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let text =
        std::str::from_utf8(&buf[..end]).map_err(|_| invalid("HTTP head is not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    for l in lines {
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| invalid(format!("HTTP header line {l:?} has no colon")))?;
        headers.push((k.trim().to_owned(), v.trim().to_owned()));
    }
    Ok(Some(Head {
        first,
        headers,
        rest: buf[end + 4..].to_vec(),
    }))
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Reads a body framed by Content-Length, by chunked encoding, or (responses only) by close.
async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    head: &Head,
    until_close: bool,
) -> std::io::Result<Vec<u8>> {
    let mut body = head.rest.clone();
    if head
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        return read_chunked(r, body).await;
    }
    match head.header("content-length") {
        Some(v) => {
            let len: usize = v
                .parse()
                .map_err(|_| invalid(format!("Content-Length {v:?} is not a number")))?;
            if len > MAX_BODY {
                return Err(invalid(format!("body of {len} bytes, limit {MAX_BODY}")));
            }
            if body.len() > len {
                return Err(invalid("more bytes than Content-Length".into()));
            }
            let have = body.len();
            body.resize(len, 0);
            r.read_exact(&mut body[have..]).await?;
            Ok(body)
        }
        None if until_close => {
            let mut chunk = [0u8; 8192];
            loop {
                let n = r.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(body);
                }
                if body.len() + n > MAX_BODY {
                    return Err(invalid(format!("body longer than {MAX_BODY} bytes")));
                }
                body.extend_from_slice(&chunk[..n]);
            }
        }
        None if body.is_empty() => Ok(body),
        None => Err(invalid("request body without Content-Length".into())),
    }
}

async fn read_chunked<R: AsyncRead + Unpin>(
    r: &mut R,
    mut raw: Vec<u8>,
) -> std::io::Result<Vec<u8>> {
    // Gathers the raw chunked stream up to its terminating zero chunk (bounded), then decodes.
    let mut body = Vec::new();
    let mut pos = 0;
    let mut chunk = [0u8; 8192];
    loop {
        // Parse as many complete chunks as `raw` holds.
        while let Some(eol) = raw[pos..].windows(2).position(|w| w == b"\r\n") {
            let size_line = std::str::from_utf8(&raw[pos..pos + eol])
                .map_err(|_| invalid("chunk size is not UTF-8".into()))?;
            let size_hex = size_line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size_hex, 16)
                .map_err(|_| invalid(format!("chunk size {size_hex:?} is not hex")))?;
            if size > MAX_BODY || body.len() + size > MAX_BODY {
                return Err(invalid(format!(
                    "chunked body longer than {MAX_BODY} bytes"
                )));
            }
            let data = pos + eol + 2;
            if size == 0 {
                return Ok(body);
            }
            if raw.len() < data + size + 2 {
                break;
            }
            body.extend_from_slice(&raw[data..data + size]);
            pos = data + size + 2;
        }
        if raw.len() - pos > MAX_BODY + 64 {
            return Err(invalid(format!(
                "chunked body longer than {MAX_BODY} bytes"
            )));
        }
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(invalid("connection closed inside a chunked body".into()));
        }
        raw.extend_from_slice(&chunk[..n]);
    }
}

/// One HTTP/1.1 exchange on a fresh connection: the status and the body.
pub(crate) async fn request(
    authority: &str,
    method: &str,
    path_and_query: &str,
    content_type: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<(u16, Vec<u8>)> {
    let what = format!("{method} http://{authority}{path_and_query}");
    let exchange = async {
        let mut s = TcpStream::connect(authority)
            .await
            .map_err(|e| metadata_err(format!("metadata store unreachable: {what}: {e}")))?;
        let _ = s.set_nodelay(true);
        let mut head = format!(
            "{method} {path_and_query} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if let Some(ct) = content_type {
            head.push_str(&format!("Content-Type: {ct}\r\n"));
        }
        head.push_str("\r\n");
        let io = |e: std::io::Error| metadata_err(format!("{what}: {e}"));
        s.write_all(head.as_bytes()).await.map_err(io)?;
        s.write_all(body).await.map_err(io)?;
        let h = read_head(&mut s)
            .await
            .map_err(io)?
            .ok_or_else(|| metadata_err(format!("{what}: the store closed without answering")))?;
        let status = h
            .first
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .filter(|_| h.first.starts_with("HTTP/1."))
            .ok_or_else(|| metadata_err(format!("{what}: bad status line {:?}", h.first)))?;
        let body = read_body(&mut s, &h, true).await.map_err(io)?;
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| metadata_err(format!("{what}: no answer within {timeout:?}")))?
}

/// A store on a server speaking Mooncake's HTTP metadata protocol (Mooncake's own
/// `mooncake_http_metadata_server`, or `omnirig metadata-server`).
#[derive(Debug, Clone)]
pub struct HttpStore {
    url: HttpUrl,
    timeout: Duration,
}

impl HttpStore {
    /// `url`: `http://host:port` (the resource `/metadata` is implied) or the full
    /// `http://host:port/metadata` as Mooncake's configuration writes it.
    pub fn new(url: &str) -> Result<Arc<Self>> {
        let mut url = HttpUrl::parse(url)?;
        if url.path.is_empty() || url.path == "/" {
            url.path = "/metadata".into();
        }
        Ok(Arc::new(Self {
            url,
            timeout: Duration::from_secs(5),
        }))
    }

    fn target(&self, key: &str) -> String {
        format!("{}?key={}", self.url.path, encode_query(key))
    }

    /// The raw value under `key` (None when the store answers 404).
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let (status, body) = request(
            &self.url.authority,
            "GET",
            &self.target(key),
            None,
            &[],
            self.timeout,
        )
        .await?;
        match status {
            200 => Ok(Some(body)),
            404 => Ok(None),
            s => Err(self.status_err("GET", key, s, &body)),
        }
    }

    pub async fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let (status, body) = request(
            &self.url.authority,
            "PUT",
            &self.target(key),
            Some("application/octet-stream"),
            value,
            self.timeout,
        )
        .await?;
        match status {
            200..=299 => Ok(()),
            s => Err(self.status_err("PUT", key, s, &body)),
        }
    }

    pub async fn delete(&self, key: &str) -> Result<()> {
        let (status, body) = request(
            &self.url.authority,
            "DELETE",
            &self.target(key),
            None,
            &[],
            self.timeout,
        )
        .await?;
        match status {
            200..=299 | 404 => Ok(()),
            s => Err(self.status_err("DELETE", key, s, &body)),
        }
    }

    fn status_err(&self, method: &str, key: &str, status: u16, body: &[u8]) -> Error {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        metadata_err(format!(
            "{method} {key:?} on http://{}{}: status {status}: {text}",
            self.url.authority, self.url.path
        ))
    }

    async fn lookup_desc(&self, name: &str) -> Result<Option<SegmentDescriptor>> {
        let key = format!("{KEY_PREFIX}{name}");
        match self.get(&key).await? {
            None => Ok(None),
            Some(bytes) => decode_entry(&key, name, &bytes).map(Some),
        }
    }
}

/// Decodes a descriptor read from a store under `key`, refusing one that names another
/// segment (a store entry is only trusted for the name it is filed under).
pub(crate) fn decode_entry(key: &str, name: &str, bytes: &[u8]) -> Result<SegmentDescriptor> {
    let d = SegmentDescriptor::from_bytes(bytes)
        .map_err(|e| Error::new(e.kind(), format!("metadata entry {key:?}: {}", e.detail())))?;
    if d.name != name {
        return Err(Error::new(
            ErrorKind::Malformed,
            format!("metadata entry {key:?} holds segment {:?}", d.name),
        ));
    }
    Ok(d)
}

pub(crate) fn duplicate(name: &str, old: u64, store: &str) -> Error {
    Error::new(
        ErrorKind::DuplicateName,
        format!(
            "segment {name:?} is already published by another engine (instance {old:016x}) in \
             {store}; if that engine is gone, delete key {KEY_PREFIX}{name}"
        ),
    )
}

impl MetadataStore for HttpStore {
    fn publish(&self, desc: SegmentDescriptor) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            desc.validate()?;
            if let Some(old) = self.lookup_desc(&desc.name).await.or_else(|e| {
                // An undecodable entry is not a live omnirig engine's: replace it.
                if e.kind() == ErrorKind::Metadata {
                    Err(e)
                } else {
                    Ok(None)
                }
            })? && old.instance != desc.instance
            {
                return Err(duplicate(
                    &desc.name,
                    old.instance,
                    &format!("http://{}{}", self.url.authority, self.url.path),
                ));
            }
            self.put(&format!("{KEY_PREFIX}{}", desc.name), &desc.to_bytes())
                .await
        })
    }

    fn lookup(&self, name: &str) -> BoxFuture<'_, Result<Option<SegmentDescriptor>>> {
        let name = name.to_owned();
        Box::pin(async move { self.lookup_desc(&name).await })
    }

    fn remove(&self, name: &str, instance: u64) -> BoxFuture<'_, Result<()>> {
        let name = name.to_owned();
        Box::pin(async move {
            // Only the owner removes its entry: a restarted engine's must survive the old
            // one's late shutdown.
            let key = format!("{KEY_PREFIX}{name}");
            match self.get(&key).await? {
                Some(bytes) => match decode_entry(&key, &name, &bytes) {
                    Ok(d) if d.instance != instance => Ok(()),
                    _ => self.delete(&key).await,
                },
                None => Ok(()),
            }
        })
    }
}

/// `omnirig metadata-server`: a key-value store speaking Mooncake's HTTP metadata protocol.
pub struct MetadataServer {
    addr: SocketAddr,
    stop: CancellationToken,
    map: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl MetadataServer {
    /// Binds `addr` and serves in the background until [`MetadataServer::stop`] or drop.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(e, &format!("binding metadata server on {addr}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(e, "metadata server address"))?;
        let stop = CancellationToken::new();
        let map = Arc::new(Mutex::new(HashMap::new()));
        tokio::spawn(accept_loop(listener, stop.clone(), map.clone()));
        Ok(Self { addr, stop, map })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many keys it holds.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for MetadataServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

type Map = Arc<Mutex<HashMap<String, Vec<u8>>>>;

async fn accept_loop(listener: TcpListener, stop: CancellationToken, map: Map) {
    loop {
        let (stream, from) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    warn!(error = %e, "metadata server accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (map, stop) = (map.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = serve_conn(stream, from, map) => {}
            }
        });
    }
}

async fn serve_conn(mut s: TcpStream, from: SocketAddr, map: Map) {
    // A client that stalls mid-request is dropped rather than held forever.
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        let head = read_head(&mut s).await?;
        match head {
            None => Ok(None),
            Some(h) => {
                let body = read_body(&mut s, &h, false).await?;
                Ok::<_, std::io::Error>(Some((h, body)))
            }
        }
    })
    .await;
    let mut line = String::new();
    let (status, reply): (u16, Vec<u8>) = match read {
        Err(_) => return,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => (400, format!("bad request: {e}").into_bytes()),
        Ok(Ok(Some((h, body)))) => {
            line = h.first.chars().take(300).collect();
            handle(&h.first, body, &map)
        }
    };
    debug!(%from, status, request = %line, "metadata request");
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        507 => "Insufficient Storage",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reply.len()
    );
    let _ = s.write_all(head.as_bytes()).await;
    let _ = s.write_all(&reply).await;
    let _ = s.shutdown().await;
}

fn handle(request_line: &str, body: Vec<u8>, map: &Map) -> (u16, Vec<u8>) {
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return (400, b"bad request line".to_vec());
    };
    if !version.starts_with("HTTP/1.") {
        return (400, b"HTTP/1.x only".to_vec());
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if path != "/metadata" {
        return (404, b"no such resource (use /metadata?key=)".to_vec());
    }
    let key = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("key="))
        .and_then(decode_query);
    let Some(key) = key.filter(|k| !k.is_empty() && k.len() <= MAX_KEY) else {
        return (
            400,
            format!("missing or bad key (1..={MAX_KEY} bytes)").into_bytes(),
        );
    };
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    match method {
        "GET" => match map.get(&key) {
            Some(v) => (200, v.clone()),
            None => (404, b"metadata not found".to_vec()),
        },
        "PUT" => {
            if !map.contains_key(&key) && map.len() >= MAX_KEYS {
                return (
                    507,
                    format!("store holds {MAX_KEYS} keys already").into_bytes(),
                );
            }
            map.insert(key, body);
            (200, b"metadata updated".to_vec())
        }
        "DELETE" => {
            map.remove(&key);
            (200, b"metadata deleted".to_vec())
        }
        _ => (405, b"GET, PUT or DELETE".to_vec()),
    }
}
