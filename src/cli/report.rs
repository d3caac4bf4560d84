//! `omnirig report RESULTS.json... --out DIR`: plots from benchmark results and run reports.

use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// `bench ... --json` results and/or a run's report.json.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Where the PNG and SVG files go.
    #[arg(long, default_value = "out/plots")]
    out: PathBuf,
}

pub fn run(a: ReportArgs) -> anyhow::Result<()> {
    let files = crate::report::render(&a.inputs, &a.out)?;
    if files.is_empty() {
        anyhow::bail!("nothing to plot in the inputs");
    }
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}
