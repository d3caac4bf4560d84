//! Hash maps keyed by integers this engine hands out itself (grant epochs, buffer ids, run
//! slots): every transfer looks them up, and SipHash, the standard map's default, was the
//! largest single cost of an 8-byte rdma write under soft-RoCE (5% of its samples). Its
//! resistance to chosen keys buys nothing here: nobody else picks these keys. A peer can make
//! us look one up (a grant epoch on the wire), never insert one.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// One multiply-rotate round per word (the FxHash scheme): consecutive ids spread over the
/// table's buckets, and the map's control bits (the hash's top bits) differ between them.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by ids this process hands out (see the module's note).
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_ids_hash_apart_and_the_map_behaves_as_a_map() {
        let b = BuildHasherDefault::<IdHasher>::default();
        let hashes: std::collections::HashSet<u64> =
            (0u64..10_000).map(|i| b.hash_one(i)).collect();
        assert_eq!(hashes.len(), 10_000);
        // the top 7 bits (hashbrown's control byte) are not all the same for neighbours
        let tops: std::collections::HashSet<u64> =
            (0u64..64).map(|i| b.hash_one(i) >> 57).collect();
        assert!(tops.len() > 32, "{} distinct top bits", tops.len());
        let mut m: IdMap<u64, u64> = IdMap::default();
        for i in 0..1000 {
            m.insert(i, i * 2);
        }
        for i in (0..1000).step_by(2) {
            m.remove(&i);
        }
        assert_eq!(m.len(), 500);
        assert!((0..1000).all(|i| m.get(&i) == (i % 2 == 1).then_some(&(i * 2))));
    }
}
