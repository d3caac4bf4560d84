//! `omnirig report RESULTS.json... --out DIR [--markdown FILE]`: the report page
//! (`DIR/index.html`, `DIR/summary.md`, every figure as PNG and SVG) from benchmark results
//! and run reports, and the markdown tables of the benchmark results.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// `bench ... --json` results and/or a run's report.json.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Where index.html, summary.md and the PNG and SVG files go.
    #[arg(long, default_value = "out/report")]
    out: PathBuf,
    /// Also write the benchmark results as markdown tables to this file (`-` for stdout).
    #[arg(long)]
    markdown: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> anyhow::Result<()> {
    if let Some(path) = &a.markdown {
        let md = crate::report::markdown(&a.inputs)?;
        if path.as_os_str() == "-" {
            print!("{md}");
        } else {
            crate::report::html::write_atomic(path, md.as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            println!("{}", path.display());
        }
    }
    for f in crate::report::write_site(&a.inputs, &a.out)? {
        println!("{}", f.display());
    }
    Ok(())
}
