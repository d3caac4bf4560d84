//! Metadata: how engines find each other's segment descriptors.
//!
//! A store is a trait; the embedded in-process store is the default, [`http::HttpStore`]
//! speaks Mooncake's HTTP metadata protocol and [`etcd::EtcdStore`] uses an etcd v3 cluster.
//! Without any store, [`crate::Engine::connect_addr`] asks the peer itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub mod etcd;
pub mod http;

use crate::error::{Error, ErrorKind, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::BoxFuture;

/// A directory of segment descriptors by name.
pub trait MetadataStore: Send + Sync + 'static {
    /// Publishes (or replaces) a descriptor. Replacing one with a different `instance`
    /// under the same name is refused unless the old one was removed: two live engines must
    /// not share a name.
    fn publish(&self, desc: SegmentDescriptor) -> BoxFuture<'_, Result<()>>;
    fn lookup(&self, name: &str) -> BoxFuture<'_, Result<Option<SegmentDescriptor>>>;
    fn remove(&self, name: &str, instance: u64) -> BoxFuture<'_, Result<()>>;
}

/// Opens the store a spec names, as command lines and cluster files write it:
/// `http://host:port[/metadata]` (Mooncake's HTTP protocol), `etcd://host:port[?ttl_s=N]`
/// (etcd v3; entries under a lease of N seconds, default 10). `p2p` (no store) is None.
pub fn open_store(spec: &str) -> Result<Option<Arc<dyn MetadataStore>>> {
    if spec == "p2p" {
        return Ok(None);
    }
    if spec.starts_with("http://") {
        return Ok(Some(http::HttpStore::new(spec)?));
    }
    if let Some(rest) = spec.strip_prefix("etcd://") {
        let (authority, ttl) = match rest.split_once("?ttl_s=") {
            Some((a, t)) => (
                a,
                t.parse::<u64>().map_err(|_| {
                    Error::new(
                        ErrorKind::Resource,
                        format!("metadata {spec:?}: ttl_s {t:?} is not a number"),
                    )
                })?,
            ),
            None => (rest, 10),
        };
        let ttl = std::time::Duration::from_secs(ttl);
        return Ok(Some(etcd::EtcdStore::new(
            &format!("http://{authority}"),
            Some(ttl),
        )?));
    }
    Err(Error::new(
        ErrorKind::Resource,
        format!("metadata {spec:?}: expected p2p, http://host:port or etcd://host:port[?ttl_s=N]"),
    ))
}

/// The embedded store: a map in this process.
#[derive(Debug, Default)]
pub struct InProcessStore {
    map: Mutex<HashMap<String, SegmentDescriptor>>,
}

impl InProcessStore {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The process-wide store engines use when none is configured.
    pub fn global() -> Arc<Self> {
        static GLOBAL: OnceLock<Arc<InProcessStore>> = OnceLock::new();
        GLOBAL.get_or_init(InProcessStore::new).clone()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, SegmentDescriptor>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl MetadataStore for InProcessStore {
    fn publish(&self, desc: SegmentDescriptor) -> BoxFuture<'_, Result<()>> {
        let r = (|| {
            desc.validate()?;
            let mut map = self.map();
            if let Some(old) = map.get(&desc.name)
                && old.instance != desc.instance
            {
                return Err(Error::new(
                    ErrorKind::DuplicateName,
                    format!(
                        "segment {:?} is already published by another engine",
                        desc.name
                    ),
                ));
            }
            map.insert(desc.name.clone(), desc);
            Ok(())
        })();
        Box::pin(async move { r })
    }

    fn lookup(&self, name: &str) -> BoxFuture<'_, Result<Option<SegmentDescriptor>>> {
        let r = self.map().get(name).cloned();
        Box::pin(async move { Ok(r) })
    }

    fn remove(&self, name: &str, instance: u64) -> BoxFuture<'_, Result<()>> {
        let mut map = self.map();
        if map.get(name).is_some_and(|d| d.instance == instance) {
            map.remove(name);
        }
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(name: &str, instance: u64) -> SegmentDescriptor {
        SegmentDescriptor::new(name, instance, vec![], vec![])
    }

    #[test]
    fn store_specs_open_or_are_refused_by_name() {
        assert!(open_store("p2p").unwrap().is_none());
        assert!(open_store("http://127.0.0.1:8080").unwrap().is_some());
        assert!(
            open_store("etcd://127.0.0.1:2379?ttl_s=5")
                .unwrap()
                .is_some()
        );
        for bad in [
            "redis://x:1",
            "etcd://x:1?ttl_s=soon",
            "etcd://x:1?ttl_s=1",
            "http://nohost",
        ] {
            let e = open_store(bad).err().unwrap();
            assert_eq!(e.kind(), ErrorKind::Resource, "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn publish_lookup_remove_and_refuse_duplicates() {
        let s = InProcessStore::new();
        s.publish(desc("a", 1)).await.unwrap();
        s.publish(desc("a", 1)).await.unwrap(); // same engine republishing
        assert_eq!(
            s.publish(desc("a", 2)).await.unwrap_err().kind(),
            ErrorKind::DuplicateName
        );
        assert_eq!(s.lookup("a").await.unwrap().unwrap().instance, 1);
        s.remove("a", 2).await.unwrap(); // not the owner: no effect
        assert!(s.lookup("a").await.unwrap().is_some());
        s.remove("a", 1).await.unwrap();
        assert!(s.lookup("a").await.unwrap().is_none());
    }
}
