//! `omnirig report RESULTS.json... --out DIR [--markdown FILE]`: plots from benchmark results
//! and run reports, and the markdown tables of the benchmark results.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// `bench ... --json` results and/or a run's report.json.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Where the PNG and SVG files go.
    #[arg(long, default_value = "out/plots")]
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
            std::fs::write(path, md).with_context(|| format!("writing {}", path.display()))?;
            println!("{}", path.display());
        }
    }
    let files = crate::report::render(&a.inputs, &a.out)?;
    if files.is_empty() && a.markdown.is_none() {
        anyhow::bail!("nothing to plot in the inputs");
    }
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}
