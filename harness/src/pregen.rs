//! Pre-generated payloads: a stage's outputs and the digests its inputs must have, made once
//! for a set of requests before any is timed (see [`crate::stage::StageWorker::pregenerate`]).
//!
//! Stage workers otherwise generate every output tensor and regenerate every input to learn
//! its expected digest, per request: hundreds of MiB of generation per request, which would
//! swamp the transfer a benchmark sets out to measure. With a [`Pregenerated`] table the
//! producer writes straight from a registered buffer holding the outputs (stage-packet and EC
//! hops) or copies them into its KV blocks, and the consumer still digests every byte that
//! arrived, comparing with a remembered digest instead of a regenerated one. Requests the
//! table does not hold are generated and checked as ever.

use std::collections::HashMap;

use omnirig_fixtures::{
    Digest128, PayloadKind, RequestPlan, TensorGenerator, TensorSpec, digest_generated,
    kv_block_digests,
};
use omnirig_model_stubs::Stub;
use omnirig_transports::{Buffer, Engine};

use crate::error::Result;

/// Tensors are found by the seed they are generated from and their name, then matched on
/// their whole spec (two requests of one seed may differ in shape).
type Key = (u64, String);

/// One pre-generated output: where its bytes lie in the table's buffer, and their digest.
#[derive(Debug, Clone)]
pub(crate) struct Output {
    pub spec: TensorSpec,
    pub offset: u64,
    pub digest: Digest128,
}

/// A stage's pre-generated outputs (bytes in one registered buffer of its outbound engine)
/// and its inputs' expected digests.
#[derive(Debug, Default)]
pub struct Pregenerated {
    buffer: Option<Buffer>,
    outputs: HashMap<Key, Vec<Output>>,
    inputs: HashMap<Key, Vec<(TensorSpec, Digest128)>>,
    kv_inputs: HashMap<Key, Vec<(TensorSpec, Vec<Digest128>)>>,
}

impl Pregenerated {
    /// Generates `stub`'s outputs for `plans` into a buffer registered with `engine` (the
    /// stage's outbound engine; None for a stage that sends nothing) and remembers the
    /// digests its inputs must have. Identical tensors are made once.
    pub(crate) fn build(
        stub: &Stub,
        engine: Option<&Engine>,
        plans: &[RequestPlan],
    ) -> Result<Self> {
        let mut t = Pregenerated::default();
        let mut layout: Vec<(Key, TensorSpec, u64)> = Vec::new();
        let mut end = 0u64;
        for plan in plans {
            if let (Some(hop), Some(_)) = (stub.outbound(plan), engine) {
                let seed = plan.content_seed(hop.payload_kind);
                for spec in &hop.tensors {
                    let key = (seed, spec.name.clone());
                    if layout.iter().any(|(k, s, _)| *k == key && s == spec) {
                        continue;
                    }
                    layout.push((key, spec.clone(), end));
                    end = (end + spec.byte_length).next_multiple_of(64);
                }
            }
            if let Some(hop) = stub.inbound(plan) {
                for spec in &hop.tensors {
                    if hop.payload_kind == PayloadKind::KvCache {
                        let key = (plan.seed, spec.name.clone());
                        let have = t.kv_inputs.entry(key).or_default();
                        if !have.iter().any(|(s, _)| s == spec) {
                            have.push((
                                spec.clone(),
                                kv_block_digests(plan.seed, hop, &spec.name)?,
                            ));
                        }
                    } else {
                        let seed = plan.content_seed(hop.payload_kind);
                        let have = t.inputs.entry((seed, spec.name.clone())).or_default();
                        if !have.iter().any(|(s, _)| s == spec) {
                            let g = TensorGenerator::new(seed, spec);
                            have.push((spec.clone(), digest_generated(&g)));
                        }
                    }
                }
            }
        }
        if let (Some(engine), false) = (engine, layout.is_empty()) {
            let buffer = engine.allocate(crate::pool::align_up(end.max(1)))?;
            for ((seed, name), spec, offset) in layout {
                let digest = buffer.fill(offset, spec.byte_length, |b| {
                    TensorGenerator::new(seed, &spec).fill_bytes(0, b)?;
                    Ok::<_, omnirig_fixtures::FixtureError>(Digest128::of_bytes(b))
                })??;
                t.outputs.entry((seed, name)).or_default().push(Output {
                    spec,
                    offset,
                    digest,
                });
            }
            t.buffer = Some(buffer);
        }
        Ok(t)
    }

    /// The registered buffer the outputs lie in.
    pub(crate) fn buffer(&self) -> Option<&Buffer> {
        self.buffer.as_ref()
    }

    /// Output `spec` generated from `seed`, if pre-generated.
    pub(crate) fn output(&self, seed: u64, spec: &TensorSpec) -> Option<&Output> {
        self.buffer.as_ref()?;
        self.outputs
            .get(&(seed, spec.name.clone()))?
            .iter()
            .find(|o| o.spec == *spec)
    }

    /// The digest input `spec` generated from `seed` must have, if remembered.
    pub(crate) fn input_digest(&self, seed: u64, spec: &TensorSpec) -> Option<Digest128> {
        self.inputs
            .get(&(seed, spec.name.clone()))?
            .iter()
            .find(|(s, _)| s == spec)
            .map(|(_, d)| *d)
    }

    /// The per-block digests KV tensor `spec` of a request of `seed` must have, if remembered.
    pub(crate) fn kv_digests(&self, seed: u64, spec: &TensorSpec) -> Option<&[Digest128]> {
        self.kv_inputs
            .get(&(seed, spec.name.clone()))?
            .iter()
            .find(|(s, _)| s == spec)
            .map(|(_, d)| d.as_slice())
    }

    /// Bytes of outputs held.
    pub fn bytes(&self) -> u64 {
        self.buffer.as_ref().map_or(0, Buffer::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnirig_fixtures::{ModelCard, ShapeOptions, Stage, golden_case, plan_request};
    use omnirig_model_stubs::ComputeTime;
    use omnirig_transports::{EngineConfig, TransportKind};

    /// The table holds exactly what the stubs would generate and expect: every output's bytes
    /// digest to the generator's, every input digest is the one the downstream stub expects,
    /// and a spec that differs in shape is not mistaken for a held one.
    #[tokio::test]
    async fn outputs_and_input_digests_match_the_stubs() {
        let card = ModelCard::qwen3_omni();
        let plan = plan_request(
            &card,
            &golden_case("image_audio").unwrap().request,
            &ShapeOptions::default(),
        )
        .unwrap();
        let engine = Engine::new(EngineConfig::for_kind("pregen", TransportKind::Loopback))
            .await
            .unwrap();
        for stage in Stage::ALL {
            let stub = Stub::new(stage, ComputeTime::default());
            let t = Pregenerated::build(&stub, Some(&engine), std::slice::from_ref(&plan)).unwrap();
            if let Some(hop) = stub.outbound(&plan) {
                let seed = plan.content_seed(hop.payload_kind);
                for spec in &hop.tensors {
                    let o = t.output(seed, spec).expect("output held");
                    let found = t
                        .buffer()
                        .unwrap()
                        .view(o.offset, spec.byte_length, Digest128::of_bytes)
                        .unwrap();
                    let want = digest_generated(&stub.generator(&plan, spec));
                    assert_eq!((found, o.digest), (want, want), "{stage} {}", spec.name);
                    let mut other = spec.clone();
                    other.byte_length += 1;
                    assert!(t.output(seed, &other).is_none());
                }
            }
            if let Some(hop) = stub.inbound(&plan) {
                for spec in &hop.tensors {
                    if hop.payload_kind == PayloadKind::KvCache {
                        let want = kv_block_digests(plan.seed, hop, &spec.name).unwrap();
                        assert_eq!(t.kv_digests(plan.seed, spec), Some(&want[..]));
                    } else {
                        let seed = plan.content_seed(hop.payload_kind);
                        let want = stub.expected_digest(&plan, &spec.name).unwrap();
                        assert_eq!(t.input_digest(seed, spec), Some(want), "{}", spec.name);
                    }
                }
            }
        }
    }
}
