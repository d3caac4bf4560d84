//! `omnirig fixtures ...`: describe request shapes, export golden hops as
//! safetensors + packet JSON, verify captures.

use anyhow::{Context, bail};
use omnirig_fixtures::golden::{export_case, golden_case, golden_cases};
use omnirig_fixtures::shapes::{AudioSpec, ImageSpec, VideoSpec};
use omnirig_fixtures::{Capture, ModelCard, RequestPlan, RequestSpec, ShapeOptions, plan_request};
use std::path::PathBuf;

#[derive(clap::Subcommand, Debug)]
pub enum FixturesCmd {
    /// Print every tensor each hop carries (dtype, shape, bytes) for a golden
    /// case or a request given by flags.
    Describe(DescribeArgs),
    /// Write `<case>.<payload_kind>.safetensors` and `.packet.json` for every
    /// hop of a golden case.
    Export(ExportArgs),
    /// Check every entry of a packet JSON against a safetensors file (dtype,
    /// shape, byte length, XXH3-128 digest), e.g. a capture from vLLM-Omni.
    Verify(VerifyArgs),
    /// List the golden cases.
    Cases,
}

#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Model card YAML (default: the embedded Qwen3-Omni-30B-A3B card).
    #[arg(long)]
    card: Option<PathBuf>,
    /// Tokens per paged-KV block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// Cache vision rows without their DeepStack features.
    #[arg(long)]
    no_deepstack: bool,
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<(ModelCard, ShapeOptions)> {
        let card = match &self.card {
            Some(path) => ModelCard::from_path(path)?,
            None => ModelCard::qwen3_omni(),
        };
        Ok((
            card,
            ShapeOptions {
                block_tokens: self.block_tokens,
                include_deepstack: !self.no_deepstack,
            },
        ))
    }
}

#[derive(clap::Args, Debug)]
pub struct DescribeArgs {
    /// A golden case (see `omnirig fixtures cases`); excludes the request flags.
    #[arg(long, conflicts_with_all = ["text_tokens", "images", "audio_seconds", "video_frames", "output_text_tokens", "output_audio_seconds", "seed"])]
    case: Option<String>,
    /// Prompt text tokens (including chat-template tokens).
    #[arg(long)]
    text_tokens: Option<u64>,
    /// An image, WIDTHxHEIGHT in pixels; repeat for more.
    #[arg(long = "image", value_parser = parse_wxh)]
    images: Vec<(u64, u64)>,
    /// An audio clip's length in seconds; repeat for more.
    #[arg(long)]
    audio_seconds: Vec<f64>,
    /// A video's frame count; repeat for more.
    #[arg(long)]
    video_frames: Vec<u64>,
    /// Pixel size of every video's frames, WIDTHxHEIGHT.
    #[arg(long, value_parser = parse_wxh, default_value = "448x448")]
    video_size: (u64, u64),
    /// Generated text tokens.
    #[arg(long)]
    output_text_tokens: Option<u64>,
    /// Seconds of generated speech (0: text-only reply, no talker hops).
    #[arg(long)]
    output_audio_seconds: Option<f64>,
    /// Seed of generated content and mm hashes.
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    model: ModelArgs,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    #[arg(long)]
    case: String,
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    #[arg(long)]
    safetensors: PathBuf,
    #[arg(long)]
    packet: PathBuf,
}

fn parse_wxh(s: &str) -> Result<(u64, u64), String> {
    let (w, h) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?} is not WIDTHxHEIGHT"))?;
    let parse = |v: &str| v.trim().parse::<u64>().map_err(|e| format!("{s:?}: {e}"));
    Ok((parse(w)?, parse(h)?))
}

pub fn run(cmd: FixturesCmd) -> anyhow::Result<()> {
    match cmd {
        FixturesCmd::Describe(args) => describe(args),
        FixturesCmd::Export(args) => export(args),
        FixturesCmd::Verify(args) => verify(args),
        FixturesCmd::Cases => {
            for case in golden_cases() {
                println!("{:<16} {}", case.name, case.description);
            }
            Ok(())
        }
    }
}

fn describe(args: DescribeArgs) -> anyhow::Result<()> {
    let (card, options) = args.model.load()?;
    let (title, request) = match &args.case {
        Some(name) => {
            let case = golden_case(name)?;
            (
                format!("case {}: {}", case.name, case.description),
                case.request,
            )
        }
        None => {
            let Some(text_tokens) = args.text_tokens else {
                bail!("give --case NAME or describe a request (at least --text-tokens N)");
            };
            let (vw, vh) = args.video_size;
            let request = RequestSpec {
                seed: args.seed.unwrap_or(0),
                text_tokens,
                images: args
                    .images
                    .iter()
                    .map(|&(width, height)| ImageSpec { width, height })
                    .collect(),
                audios: args
                    .audio_seconds
                    .iter()
                    .map(|&seconds| AudioSpec { seconds })
                    .collect(),
                videos: args
                    .video_frames
                    .iter()
                    .map(|&frames| VideoSpec {
                        frames,
                        width: vw,
                        height: vh,
                    })
                    .collect(),
                output_text_tokens: args.output_text_tokens.unwrap_or(0),
                output_audio_seconds: args.output_audio_seconds.unwrap_or(0.0),
                salt: 0,
            };
            ("request".to_string(), request)
        }
    };
    let plan = plan_request(&card, &request, &options)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render_plan(&card, &title, &plan));
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

fn render_plan(card: &ModelCard, title: &str, plan: &RequestPlan) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "{} | {title}", card.name);
    let mm: u64 = plan.mm_items.iter().map(|m| m.tokens).sum();
    let _ = writeln!(
        out,
        "prompt {} tokens (text {}, multimodal {mm}); output {} text tokens, {} codec frames",
        plan.prompt_tokens,
        plan.prompt_tokens - mm,
        plan.output_text_tokens,
        plan.codec_frames
    );
    for m in &plan.mm_items {
        let _ = writeln!(
            out,
            "  {:<28} {:>6} tokens  mm_hash {}",
            m.description, m.tokens, m.mm_hash
        );
    }
    for hop in &plan.hops {
        let _ = writeln!(
            out,
            "\n{} -> {} ({})",
            hop.source, hop.target, hop.payload_kind
        );
        let name_w = hop
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let _ = writeln!(
            out,
            "  {:<name_w$}  {:<5}  {:<22}  {:>14}",
            "name", "dtype", "shape", "bytes"
        );
        for t in &hop.tensors {
            let _ = writeln!(
                out,
                "  {:<name_w$}  {:<5}  {:<22}  {:>14}",
                t.name,
                t.dtype.as_str(),
                format!("{:?}", t.shape),
                t.byte_length
            );
        }
        let total = hop.total_bytes();
        let _ = writeln!(
            out,
            "  {:<name_w$}  {:<5}  {:<22}  {:>14}  ({})",
            "total",
            "",
            "",
            total,
            human(total)
        );
        if let Some(kv) = &hop.kv {
            let _ = writeln!(
                out,
                "  kv: {} tokens in {} blocks of {} tokens; per layer K block {} B, V block {} B; {} layers; {} per block over all layers",
                kv.tokens,
                kv.num_blocks,
                kv.block_tokens,
                kv.k_block_bytes,
                kv.v_block_bytes,
                kv.num_layers,
                human((kv.k_block_bytes + kv.v_block_bytes) * u64::from(kv.num_layers)),
            );
        }
    }
    let _ = writeln!(
        out,
        "\nall hops: {} bytes ({})",
        plan.total_bytes(),
        human(plan.total_bytes())
    );
    out
}

fn export(args: ExportArgs) -> anyhow::Result<()> {
    let (card, options) = args.model.load()?;
    let case = golden_case(&args.case)?;
    // Each tensor is generated whole in memory before it is written: a card that makes one
    // larger than the machine has is refused here, not by the kernel's OOM killer.
    let plan = plan_request(&card, &case.request, &options)?;
    let largest = plan
        .hops
        .iter()
        .flat_map(|h| &h.tensors)
        .max_by_key(|t| t.byte_length);
    if let (Some(t), Some(avail)) = (largest, omnirig_transports::memory::mem_available())
        && t.byte_length > avail
    {
        bail!(
            "case {}: tensor {} is {} bytes, more than the {avail} bytes this machine has available (MemAvailable)",
            case.name,
            t.name,
            t.byte_length
        );
    }
    let written = export_case(&card, &case, &options, &args.out)
        .with_context(|| format!("exporting case {} to {}", case.name, args.out.display()))?;
    for hop in written {
        let bytes = std::fs::metadata(&hop.safetensors)
            .map(|m| m.len())
            .unwrap_or(0);
        println!(
            "{}  ({}, {} tensors)",
            hop.safetensors.display(),
            human(bytes),
            hop.packet.entries.len()
        );
        println!("{}", hop.packet_json.display());
    }
    Ok(())
}

fn verify(args: VerifyArgs) -> anyhow::Result<()> {
    let capture = Capture::load(&args.safetensors, &args.packet)?;
    capture.verify().with_context(|| {
        format!(
            "{} does not match {}",
            args.safetensors.display(),
            args.packet.display()
        )
    })?;
    for e in &capture.packet.entries {
        println!(
            "ok  {:<24} {:<5} {:<20} {:>12}  {}",
            e.name,
            e.dtype.as_str(),
            format!("{:?}", e.shape),
            e.byte_length,
            e.digest
        );
    }
    println!(
        "verified {} entries of {} packet {} (request {})",
        capture.packet.entries.len(),
        capture.packet.payload_kind,
        args.packet.display(),
        capture.packet.request_id
    );
    Ok(())
}
