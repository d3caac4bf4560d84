//! KV connector state (no I/O): paged block pools with a prefix cache, the
//! block lists decode sends, and coalescing of block runs into requests.
//!
//! Like vLLM's P/D connectors: decode allocates its own block ids (they differ
//! from prefill's), grants each contiguous run of its blocks per layer and K/V,
//! and prefill writes every run that is contiguous on both sides as one
//! request. Blocks decode already holds for the prompt's prefix do not move.

use std::collections::{BTreeSet, HashMap, VecDeque};

use omnirig_fixtures::{Digest128, KvLayout};
use omnirig_transports::Grant;
use serde::{Deserialize, Serialize};

/// Identity of a full block's content: (prompt content, block index). In this
/// rig a request's prompt content is a function of its seed, so requests with
/// the same seed share their common full blocks.
pub type BlockHash = u128;

/// Hash of full block `index` of a prompt generated from `seed`.
pub fn block_hash(seed: u64, index: u64) -> BlockHash {
    Digest128::of_bytes(format!("omnirig-kv-prefix-v1;seed={seed};block={index}").as_bytes()).0
}

/// Paged block allocator with refcounts and a prefix cache (vLLM's
/// KVCacheManager in miniature). Blocks with a hash and no users stay cached
/// (evictable, least recently released first) until space is needed.
#[derive(Debug, Clone)]
pub struct BlockPool {
    capacity: u32,
    free: BTreeSet<u32>,
    refs: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    evictable: VecDeque<u32>,
}

impl BlockPool {
    /// Blocks `0..reserved` are never handed out (vLLM keeps block 0 as its null block).
    pub fn new(capacity: u32, reserved: u32) -> Self {
        Self {
            capacity,
            free: (reserved.min(capacity)..capacity).collect(),
            refs: vec![0; capacity as usize],
            hash_of: vec![None; capacity as usize],
            cached: HashMap::new(),
            evictable: VecDeque::new(),
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Takes `n` blocks, lowest free ids first, evicting cached blocks if needed.
    /// All or nothing.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() + self.evictable.len() < n {
            return None;
        }
        while self.free.len() < n {
            let b = self.evictable.pop_front()?;
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cached.remove(&h);
            }
            self.free.insert(b);
        }
        let out: Vec<u32> = self.free.iter().take(n).copied().collect();
        for &b in &out {
            self.free.remove(&b);
            self.refs[b as usize] = 1;
        }
        Some(out)
    }

    /// The longest cached prefix of `hashes`, each block taken (refcount + 1).
    pub fn lookup_prefix(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            if self.refs[b as usize] == 0 {
                self.evictable.retain(|&x| x != b);
            }
            self.refs[b as usize] += 1;
            out.push(b);
        }
        out
    }

    /// Marks a held block's content as `hash` (after it was verified), so later
    /// requests can reuse it. A hash already cached elsewhere is left alone.
    pub fn commit(&mut self, block: u32, hash: BlockHash) {
        if self.cached.contains_key(&hash) || self.hash_of[block as usize].is_some() {
            return;
        }
        self.cached.insert(hash, block);
        self.hash_of[block as usize] = Some(hash);
    }

    /// Drops one use of each block; unused blocks become free, or evictable if cached.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0, "block {b} released twice");
            *r = r.saturating_sub(1);
            if *r == 0 {
                if self.hash_of[b as usize].is_some() {
                    self.evictable.push_back(b);
                } else {
                    self.free.insert(b);
                }
            }
        }
    }

    /// Forgets every unused cached block.
    pub fn clear_cache(&mut self) {
        while let Some(b) = self.evictable.pop_front() {
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cached.remove(&h);
            }
            self.free.insert(b);
        }
    }

    /// Blocks in use by requests now.
    pub fn in_use(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// Unused blocks kept for prefix hits.
    pub fn cached(&self) -> usize {
        self.evictable.len()
    }
}

/// A run of blocks contiguous on both sides: `len` blocks from `src` to `dst`,
/// covering logical blocks `logical..logical+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub logical: u32,
    pub src: u32,
    pub dst: u32,
    pub len: u32,
}

/// Splits a block mapping (logical block `first + i` lives at `src[i]` and goes to
/// `dst[i]`) into maximal runs contiguous on both sides: one transfer request each.
pub fn coalesce(first: u32, src: &[u32], dst: &[u32]) -> Vec<Run> {
    debug_assert_eq!(src.len(), dst.len());
    let mut runs: Vec<Run> = Vec::new();
    for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
        match runs.last_mut() {
            Some(r) if r.src + r.len == s && r.dst + r.len == d => r.len += 1,
            _ => runs.push(Run {
                logical: first + i as u32,
                src: s,
                dst: d,
                len: 1,
            }),
        }
    }
    runs
}

/// Maximal runs of consecutive ids in `ids`: (index of first, first id, len).
pub fn contiguous_runs(ids: &[u32]) -> Vec<(u32, u32, u32)> {
    let mut out: Vec<(u32, u32, u32)> = Vec::new();
    for (i, &b) in ids.iter().enumerate() {
        match out.last_mut() {
            Some((_, start, len)) if *start + *len == b => *len += 1,
            _ => out.push((i as u32, b, 1)),
        }
    }
    out
}

/// Where paged KV lives in one registered buffer: per layer, K then V, each a
/// `capacity`-block array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_layers: u32,
    pub capacity: u32,
    pub block_bytes: u64,
}

impl KvGeometry {
    pub fn for_layout(kv: &KvLayout, capacity: u32) -> Self {
        Self {
            num_layers: kv.num_layers,
            capacity,
            block_bytes: kv.k_block_bytes,
        }
    }

    /// Saturating: a buffer that large is refused when registered, never wrapped.
    pub fn buffer_bytes(&self) -> u64 {
        (u64::from(self.num_layers) * 2)
            .saturating_mul(u64::from(self.capacity))
            .saturating_mul(self.block_bytes)
    }

    /// Byte offset of `block` of layer `layer`, K (`v == false`) or V.
    pub fn offset(&self, layer: u32, v: bool, block: u32) -> u64 {
        ((u64::from(layer) * 2 + u64::from(v)) * u64::from(self.capacity) + u64::from(block))
            * self.block_bytes
    }
}

/// One grant of a KV reservation: decode blocks `dst_blocks[start..start+len]`
/// of one layer's K or V (contiguous ids).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGrant {
    pub layer: u32,
    pub v: bool,
    pub start: u32,
    pub len: u32,
    pub grant: Grant,
}

/// Decode's reservation: logical blocks `first_block..` go to `dst_blocks`
/// (logical blocks before `first_block` were a prefix hit and do not move).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvReservation {
    pub first_block: u32,
    #[serde(deserialize_with = "crate::control::bounded")]
    pub dst_blocks: Vec<u32>,
    #[serde(deserialize_with = "crate::control::bounded")]
    pub grants: Vec<KvGrant>,
}

/// A planned write: `run` of layer `layer` K/V into `grants[grant]` at `grant_offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvWrite {
    pub layer: u32,
    pub v: bool,
    pub run: Run,
    pub grant: usize,
    pub grant_offset: u64,
}

/// Prefill's side: given its own block ids for every logical block and decode's
/// reservation, the writes to issue (one per run contiguous on both sides).
/// Refuses reservations that do not match the request's geometry.
pub fn plan_kv_writes(
    src_blocks: &[u32],
    res: &KvReservation,
    num_layers: u32,
    block_bytes: u64,
) -> Result<Vec<KvWrite>, String> {
    let first = res.first_block as usize;
    if first + res.dst_blocks.len() != src_blocks.len() {
        return Err(format!(
            "reservation covers blocks {first}..{} but the request has {} blocks",
            first + res.dst_blocks.len(),
            src_blocks.len()
        ));
    }
    let runs = coalesce(res.first_block, &src_blocks[first..], &res.dst_blocks);
    let mut out = Vec::with_capacity(runs.len() * num_layers as usize * 2);
    // Index grants by (layer, v) for lookup of the one covering a run.
    let mut by_tensor: HashMap<(u32, bool), Vec<usize>> = HashMap::new();
    for (i, g) in res.grants.iter().enumerate() {
        if g.grant.len != u64::from(g.len) * block_bytes {
            return Err(format!(
                "grant for layer {} {} covers {} bytes, not {} blocks",
                g.layer,
                if g.v { "v" } else { "k" },
                g.grant.len,
                g.len
            ));
        }
        by_tensor.entry((g.layer, g.v)).or_default().push(i);
    }
    for layer in 0..num_layers {
        for v in [false, true] {
            let grants = by_tensor.get(&(layer, v)).map(Vec::as_slice).unwrap_or(&[]);
            for run in &runs {
                let idx = run.logical - res.first_block;
                let gi = grants
                    .iter()
                    .copied()
                    .find(|&gi| {
                        let g = &res.grants[gi];
                        g.start <= idx && idx + run.len <= g.start + g.len
                    })
                    .ok_or_else(|| {
                        format!(
                            "no grant covers blocks {}..{} of {}",
                            run.logical,
                            run.logical + run.len,
                            if v {
                                KvLayout::v_name(layer)
                            } else {
                                KvLayout::k_name(layer)
                            }
                        )
                    })?;
                let g = &res.grants[gi];
                out.push(KvWrite {
                    layer,
                    v,
                    run: *run,
                    grant: gi,
                    grant_offset: u64::from(idx - g.start) * block_bytes,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_transports::Access;

    #[test]
    fn coalesces_runs_contiguous_on_both_sides() {
        let runs = coalesce(0, &[0, 1, 2, 3, 7, 8], &[5, 6, 9, 10, 11, 12]);
        assert_eq!(
            runs,
            vec![
                Run {
                    logical: 0,
                    src: 0,
                    dst: 5,
                    len: 2
                },
                Run {
                    logical: 2,
                    src: 2,
                    dst: 9,
                    len: 2
                },
                Run {
                    logical: 4,
                    src: 7,
                    dst: 11,
                    len: 2
                },
            ]
        );
        assert_eq!(
            coalesce(3, &[4], &[1]),
            vec![Run {
                logical: 3,
                src: 4,
                dst: 1,
                len: 1
            }]
        );
        assert!(coalesce(0, &[], &[]).is_empty());
        assert_eq!(
            contiguous_runs(&[5, 6, 9, 10, 11, 2]),
            vec![(0, 5, 2), (2, 9, 3), (5, 2, 1)]
        );
    }

    #[test]
    fn prefill_and_decode_ids_differ_and_remap() {
        let mut prefill = BlockPool::new(16, 0);
        let mut decode = BlockPool::new(16, 1);
        let src = prefill.alloc(4).unwrap();
        let dst = decode.alloc(4).unwrap();
        assert_eq!(
            (src.clone(), dst.clone()),
            (vec![0, 1, 2, 3], vec![1, 2, 3, 4])
        );
        let grant = |len: u32| Grant {
            segment: "d".into(),
            buffer: 1,
            offset: 0,
            len: u64::from(len) * 10,
            epoch: 1,
            token: 1,
            access: Access::Write,
            keys: Vec::new(),
        };
        let res = KvReservation {
            first_block: 0,
            dst_blocks: dst,
            grants: (0..2)
                .flat_map(|l| {
                    [false, true].map(|v| KvGrant {
                        layer: l,
                        v,
                        start: 0,
                        len: 4,
                        grant: grant(4),
                    })
                })
                .collect(),
        };
        let writes = plan_kv_writes(&src, &res, 2, 10).unwrap();
        assert_eq!(writes.len(), 4, "one run per layer and K/V");
        assert!(writes.iter().all(|w| w.run
            == Run {
                logical: 0,
                src: 0,
                dst: 1,
                len: 4
            }));
        // A reservation for the wrong number of blocks is refused.
        let short = KvReservation {
            dst_blocks: vec![1, 2],
            ..res.clone()
        };
        assert!(plan_kv_writes(&src, &short, 2, 10).is_err());
        // A missing grant is named.
        let missing = KvReservation {
            grants: res.grants[..3].to_vec(),
            ..res
        };
        let err = plan_kv_writes(&src, &missing, 2, 10).unwrap_err();
        assert!(err.contains("kv.layer.1.v"), "{err}");
    }

    #[test]
    fn prefix_hit_moves_only_the_tail() {
        let mut decode = BlockPool::new(16, 1);
        let hashes: Vec<_> = (0..3).map(|i| block_hash(7, i)).collect();
        let first = decode.alloc(4).unwrap();
        for (b, h) in first.iter().zip(&hashes) {
            decode.commit(*b, *h);
        }
        decode.release(&first);
        assert_eq!((decode.in_use(), decode.cached()), (0, 3));
        // Same prompt content, longer: 3 full blocks hit, only the tail is allocated.
        let more: Vec<_> = (0..5).map(|i| block_hash(7, i)).collect();
        let hit = decode.lookup_prefix(&more);
        assert_eq!(hit, first[..3]);
        let tail = decode.alloc(3).unwrap();
        assert!(tail.iter().all(|b| !hit.contains(b)));
        let src: Vec<u32> = (0..6).collect();
        let res = KvReservation {
            first_block: 3,
            dst_blocks: tail.clone(),
            grants: vec![KvGrant {
                layer: 0,
                v: false,
                start: 0,
                len: 3,
                grant: Grant {
                    segment: "d".into(),
                    buffer: 1,
                    offset: 0,
                    len: 30,
                    epoch: 1,
                    token: 1,
                    access: Access::Write,
                    keys: Vec::new(),
                },
            }],
        };
        let w = plan_kv_writes(&src, &res, 1, 10);
        // Only K of layer 0 is granted here; V is named missing.
        assert!(w.unwrap_err().contains("kv.layer.0.v"));
        // Other seeds miss.
        assert!(decode.lookup_prefix(&[block_hash(8, 0)]).is_empty());
        decode.release(&hit);
        decode.release(&tail);
        decode.clear_cache();
        assert_eq!((decode.in_use(), decode.cached()), (0, 0));
        // Eviction: a full pool reuses cached blocks.
        let all = decode.alloc(15).unwrap();
        assert_eq!(all.len(), 15);
    }
}
