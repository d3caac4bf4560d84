//! The five Qwen3-Omni stage stubs.
//!
//! A stub stands in for a stage's model: it checks that every inbound tensor
//! is bit-exact against what its upstream stub must have produced for the
//! request, and produces its own outputs from the fixtures generator. Every
//! stub's output for a tensor is `TensorGenerator::new(plan.content_seed(hop), spec)`,
//! so a downstream check needs only the request plan, never the upstream process.
//!
//! | stub            | consumes              | produces              | compute unit      |
//! |-----------------|-----------------------|-----------------------|-------------------|
//! | Encoder         | (raw media)           | encoder embeddings    | mm tokens / items |
//! | ThinkerPrefill  | encoder embeddings    | paged KV cache        | prompt tokens     |
//! | ThinkerDecode   | paged KV cache        | thinker -> talker     | output text tokens|
//! | Talker          | thinker -> talker     | codec codes           | codec frames      |
//! | Code2Wav        | codec codes           | waveform (local only) | codec frames      |

use std::time::Duration;

use omnirig_fixtures::{
    Digest128, FixtureError, Hop, ModelCard, PayloadKind, RequestPlan, Stage, TensorGenerator,
    TensorSpec, check_blocks, digest_generated, kv_block_digests,
};
use serde::{Deserialize, Serialize};

/// Tensors at most this large are also compared byte by byte against a fresh
/// generation (cheap), on top of the digest.
pub const BYTE_COMPARE_MAX: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StubError {
    #[error("{stage}: tensor {tensor:?} is not an input of this stage for this request")]
    NotAnInput { stage: Stage, tensor: String },
    #[error("{stage}: tensor {tensor:?}: {found} bytes arrived, {expected} expected")]
    Length {
        stage: Stage,
        tensor: String,
        expected: u64,
        found: u64,
    },
    #[error("{stage}: tensor {tensor:?}: digest {found} differs from the expected {expected}")]
    Digest {
        stage: Stage,
        tensor: String,
        expected: String,
        found: String,
    },
    #[error("{stage}: tensor {tensor:?}: first differing byte at offset {offset}")]
    Bytes {
        stage: Stage,
        tensor: String,
        offset: u64,
    },
    #[error("{stage}: {source}")]
    Fixture {
        stage: Stage,
        #[source]
        source: FixtureError,
    },
}

pub type Result<T, E = StubError> = std::result::Result<T, E>;

/// Modelled compute time of a stage: `per_token_us` per unit of work (see the
/// table in the crate docs) plus `per_item_us` per request (the encoder: per
/// multimodal item). Zero by default, so tests measure the data plane alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeTime {
    #[serde(default)]
    pub per_token_us: u64,
    #[serde(default)]
    pub per_item_us: u64,
}

/// One stage's model stub.
#[derive(Clone, Debug)]
pub struct Stub {
    stage: Stage,
    compute: ComputeTime,
}

impl Stub {
    pub fn new(stage: Stage, compute: ComputeTime) -> Stub {
        Stub { stage, compute }
    }
    pub fn encoder(compute: ComputeTime) -> Stub {
        Stub::new(Stage::Encoder, compute)
    }
    pub fn thinker_prefill(compute: ComputeTime) -> Stub {
        Stub::new(Stage::ThinkerPrefill, compute)
    }
    pub fn thinker_decode(compute: ComputeTime) -> Stub {
        Stub::new(Stage::ThinkerDecode, compute)
    }
    pub fn talker(compute: ComputeTime) -> Stub {
        Stub::new(Stage::Talker, compute)
    }
    pub fn code2wav(compute: ComputeTime) -> Stub {
        Stub::new(Stage::Code2wav, compute)
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The hop this stage receives for `plan`, if any.
    pub fn inbound<'a>(&self, plan: &'a RequestPlan) -> Option<&'a Hop> {
        plan.hops.iter().find(|h| h.target == self.stage)
    }

    /// The hop this stage sends for `plan`, if any.
    pub fn outbound<'a>(&self, plan: &'a RequestPlan) -> Option<&'a Hop> {
        plan.hops.iter().find(|h| h.source == self.stage)
    }

    /// Whether this stage has anything to do for `plan` (the encoder has no
    /// work for text-only prompts, talker and code2wav none without audio out).
    pub fn participates(&self, plan: &RequestPlan) -> bool {
        match self.stage {
            Stage::Encoder => self.outbound(plan).is_some(),
            Stage::ThinkerPrefill | Stage::ThinkerDecode => true,
            Stage::Talker | Stage::Code2wav => self.inbound(plan).is_some(),
        }
    }

    fn input_spec<'a>(&self, plan: &'a RequestPlan, tensor: &str) -> Result<&'a TensorSpec> {
        self.inbound(plan)
            .and_then(|h| h.tensor(tensor))
            .ok_or_else(|| StubError::NotAnInput {
                stage: self.stage,
                tensor: tensor.into(),
            })
    }

    /// The generator this stage's model produces `spec` with (its outputs).
    pub fn generator(&self, plan: &RequestPlan, spec: &TensorSpec) -> TensorGenerator {
        TensorGenerator::new(self.seed(plan, self.outbound(plan)), spec)
    }

    /// The seed of `hop`'s tensors (see `RequestPlan::content_seed`).
    fn seed(&self, plan: &RequestPlan, hop: Option<&Hop>) -> u64 {
        hop.map_or(plan.seed, |h| plan.content_seed(h.payload_kind))
    }

    /// Produces bytes `byte_offset..byte_offset+out.len()` of output tensor
    /// `spec` straight into `out` (registered memory, a KV block alone, ...).
    pub fn produce(
        &self,
        plan: &RequestPlan,
        spec: &TensorSpec,
        byte_offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        self.generator(plan, spec)
            .fill_bytes(byte_offset, out)
            .map_err(|source| StubError::Fixture {
                stage: self.stage,
                source,
            })
    }

    /// The digest the upstream stub's output `tensor` must have.
    pub fn expected_digest(&self, plan: &RequestPlan, tensor: &str) -> Result<Digest128> {
        let spec = self.input_spec(plan, tensor)?;
        // The upstream stub generates from the same (seed, spec).
        let seed = self.seed(plan, self.inbound(plan));
        Ok(digest_generated(&TensorGenerator::new(seed, spec)))
    }

    /// Checks an inbound tensor that arrived whole: length, digest, and a byte
    /// compare against a fresh generation when small. Returns the digest found.
    pub fn check_input(&self, plan: &RequestPlan, tensor: &str, bytes: &[u8]) -> Result<Digest128> {
        let spec = self.input_spec(plan, tensor)?;
        if bytes.len() as u64 != spec.byte_length {
            return Err(StubError::Length {
                stage: self.stage,
                tensor: tensor.into(),
                expected: spec.byte_length,
                found: bytes.len() as u64,
            });
        }
        let found = Digest128::of_bytes(bytes);
        let expected = self.expected_digest(plan, tensor)?;
        if found != expected {
            return Err(StubError::Digest {
                stage: self.stage,
                tensor: tensor.into(),
                expected: expected.to_hex(),
                found: found.to_hex(),
            });
        }
        if spec.byte_length <= BYTE_COMPARE_MAX {
            let fresh = TensorGenerator::new(self.seed(plan, self.inbound(plan)), spec).generate();
            if let Some(offset) = fresh.iter().zip(bytes).position(|(a, b)| a != b) {
                return Err(StubError::Bytes {
                    stage: self.stage,
                    tensor: tensor.into(),
                    offset: offset as u64,
                });
            }
        }
        Ok(found)
    }

    /// Checks one KV tensor by blocks: `received[i]` is the digest of the block
    /// found where logical block `i` should be. A wrong mapping is named
    /// (which source block landed where).
    pub fn check_kv_blocks(
        &self,
        plan: &RequestPlan,
        tensor: &str,
        received: &[Digest128],
    ) -> Result<()> {
        let hop = self
            .inbound(plan)
            .filter(|h| h.payload_kind == PayloadKind::KvCache)
            .ok_or_else(|| StubError::NotAnInput {
                stage: self.stage,
                tensor: tensor.into(),
            })?;
        let fx = |source| StubError::Fixture {
            stage: self.stage,
            source,
        };
        let expected = kv_block_digests(plan.seed, hop, tensor).map_err(fx)?;
        check_blocks(tensor, &expected, received).map_err(fx)
    }

    /// Units of work for the compute model (see the crate docs).
    pub fn work_units(&self, plan: &RequestPlan) -> (u64, u64) {
        match self.stage {
            Stage::Encoder => (
                plan.mm_items.iter().map(|i| i.tokens).sum(),
                plan.mm_items.len() as u64,
            ),
            Stage::ThinkerPrefill => (plan.prompt_tokens, 1),
            Stage::ThinkerDecode => (plan.output_text_tokens, 1),
            Stage::Talker | Stage::Code2wav => (plan.codec_frames, 1),
        }
    }

    /// Modelled compute time for `plan` (zero unless configured).
    pub fn compute_time(&self, plan: &RequestPlan) -> Duration {
        let (tokens, items) = self.work_units(plan);
        Duration::from_micros(
            self.compute
                .per_token_us
                .saturating_mul(tokens)
                .saturating_add(self.compute.per_item_us.saturating_mul(items)),
        )
    }
}

/// Waveform samples Code2Wav renders for `plan` (it produces no transferred tensor).
pub fn waveform_samples(card: &ModelCard, plan: &RequestPlan) -> u64 {
    plan.codec_frames * card.code2wav.samples_per_frame
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_fixtures::{ShapeOptions, golden_case, plan_request};

    fn plan(name: &str) -> RequestPlan {
        plan_request(
            &ModelCard::qwen3_omni(),
            &golden_case(name).unwrap().request,
            &ShapeOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn produced_outputs_pass_the_downstream_check() {
        let p = plan("image_audio");
        for hop in &p.hops {
            let up = Stub::new(hop.source, ComputeTime::default());
            let down = Stub::new(hop.target, ComputeTime::default());
            for t in hop.tensors.iter().filter(|t| t.byte_length < (8 << 20)) {
                let mut bytes = vec![0u8; t.byte_length as usize];
                up.produce(&p, t, 0, &mut bytes).unwrap();
                down.check_input(&p, &t.name, &bytes).unwrap();
                let mid = bytes.len() / 2;
                bytes[mid] ^= 1;
                assert!(matches!(
                    down.check_input(&p, &t.name, &bytes),
                    Err(StubError::Digest { .. })
                ));
            }
        }
    }

    /// Identical requests with different salts: the cached hops (encoder embeddings, KV)
    /// stay equal so caches hit; the hops downstream of them differ, so bytes of one request
    /// can never pass for another's.
    #[test]
    fn salt_varies_only_the_outputs_downstream_of_the_caches() {
        let a = plan("image_audio");
        let mut spec = golden_case("image_audio").unwrap().request;
        spec.salt = 1;
        let b = plan_request(&ModelCard::qwen3_omni(), &spec, &ShapeOptions::default()).unwrap();
        for hop in &a.hops {
            let up = Stub::new(hop.source, ComputeTime::default());
            let down = Stub::new(hop.target, ComputeTime::default());
            let t = hop.tensors.iter().min_by_key(|t| t.byte_length).unwrap();
            let mut bytes = vec![0u8; t.byte_length as usize];
            up.produce(&b, t, 0, &mut bytes).unwrap();
            down.check_input(&b, &t.name, &bytes).unwrap();
            let cached = matches!(
                hop.payload_kind,
                PayloadKind::EncoderEmbeddings | PayloadKind::KvCache
            );
            assert_eq!(
                down.check_input(&a, &t.name, &bytes).is_ok(),
                cached,
                "{}",
                hop.payload_kind
            );
        }
    }

    #[test]
    fn kv_blocks_out_of_place_are_named() {
        let p = plan("text_short");
        let hop = p.hop(PayloadKind::KvCache).unwrap();
        let name = "kv.layer.3.v";
        let mut digests = kv_block_digests(p.seed, hop, name).unwrap();
        let decode = Stub::thinker_decode(ComputeTime::default());
        decode.check_kv_blocks(&p, name, &digests).unwrap();
        digests.swap(0, 1);
        let err = decode
            .check_kv_blocks(&p, name, &digests)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blocks[0]") && err.contains("block 1"),
            "{err}"
        );
    }

    #[test]
    fn compute_time_scales_with_work() {
        let p = plan("text_short");
        let s = Stub::thinker_decode(ComputeTime {
            per_token_us: 10,
            per_item_us: 5,
        });
        assert_eq!(s.compute_time(&p), Duration::from_micros(10 * 24 + 5));
        assert!(
            Stub::encoder(ComputeTime::default())
                .compute_time(&p)
                .is_zero()
        );
        assert!(!Stub::encoder(ComputeTime::default()).participates(&p));
    }
}
