//! The report page: one self-contained `index.html` (styles and every figure's SVG inline, no
//! script, no network) and the same sections as `summary.md`. Both come from one [`Page`], so
//! the tables and verdicts read the same in a browser and pasted into an issue.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// `s` with the five characters HTML gives meaning replaced by entities.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A cell for a markdown table: pipes escaped, line breaks flattened.
fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// A table: header cells, which columns hold numbers (right-aligned), rows of cells.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub head: Vec<String>,
    pub numeric: Vec<bool>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns given as (header, numeric).
    pub fn new(cols: &[(&str, bool)]) -> Self {
        Table {
            head: cols.iter().map(|c| c.0.to_string()).collect(),
            numeric: cols.iter().map(|c| c.1).collect(),
            rows: vec![],
        }
    }

    pub fn push(&mut self, row: Vec<String>) {
        debug_assert_eq!(row.len(), self.head.len());
        self.rows.push(row);
    }

    fn html(&self) -> String {
        let mut s = String::from("<table>\n<thead><tr>");
        for (h, n) in self.head.iter().zip(&self.numeric) {
            s += &format!(
                "<th{}>{}</th>",
                if *n { " class=\"n\"" } else { "" },
                esc(h)
            );
        }
        s += "</tr></thead>\n<tbody>\n";
        for r in &self.rows {
            s += "<tr>";
            for (c, n) in r.iter().zip(&self.numeric) {
                s += &format!(
                    "<td{}>{}</td>",
                    if *n { " class=\"n\"" } else { "" },
                    esc(c)
                );
            }
            s += "</tr>\n";
        }
        s + "</tbody>\n</table>\n"
    }

    fn markdown(&self) -> String {
        let mut s = format!(
            "| {} |\n|{}\n",
            self.head
                .iter()
                .map(|h| md_cell(h))
                .collect::<Vec<_>>()
                .join(" | "),
            self.numeric
                .iter()
                .map(|n| if *n { "---:|" } else { "---|" })
                .collect::<String>()
        );
        for r in &self.rows {
            s += &format!(
                "| {} |\n",
                r.iter().map(|c| md_cell(c)).collect::<Vec<_>>().join(" | ")
            );
        }
        s
    }
}

/// A drawn figure: its file stem, title and the SVG document to inline.
#[derive(Debug, Clone)]
pub struct FigureRef {
    pub name: String,
    pub title: String,
    pub svg: String,
}

#[derive(Debug, Clone)]
pub enum Block {
    Heading(String),
    Para(String),
    /// Verdict lines: the issue's targets checked against a run, printed as the bench did.
    Verdicts(Vec<String>),
    Table(Table),
    Pre(String),
    Figure(FigureRef),
}

#[derive(Debug, Clone)]
pub struct Section {
    pub id: String,
    pub title: String,
    pub blocks: Vec<Block>,
}

#[derive(Debug, Clone, Default)]
pub struct Page {
    pub title: String,
    /// Lines under the title: what the page was written from.
    pub meta: Vec<String>,
    pub sections: Vec<Section>,
}

const STYLE: &str = "body{font-family:'DejaVu Sans',Verdana,sans-serif;margin:1.5em auto;max-width:1240px;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}h3{margin-bottom:.3em}
p.meta{color:#555;margin:.1em 0}nav ul{columns:2;padding-left:1.2em}
table{border-collapse:collapse;margin:.6em 0 1em;font-size:.85em;display:block;overflow-x:auto;max-width:100%}
th,td{border:1px solid #ccc;padding:.2em .5em;white-space:nowrap}th{background:#f2f2f2}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
ul.verdicts{list-style:none;padding-left:0;font-family:'DejaVu Sans Mono',monospace;font-size:.82em}
ul.verdicts li{padding:.15em .4em;border-left:4px solid #bbb;margin:.15em 0;white-space:pre-wrap}
ul.verdicts li.met{border-color:#2ca02c;background:#f0faf0}ul.verdicts li.missed{border-color:#d62728;background:#fdf0f0}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.82em}
figure{margin:1em 0;border:1px solid #ddd;padding:4px}figure svg{display:block;width:100%;height:auto}
figcaption{font-size:.85em;color:#555;padding:.3em}";

/// Verdict lines say `met` or `MISSED` when they judge a target.
fn verdict_class(line: &str) -> &'static str {
    if line.contains("MISSED") || line.contains("FAILED") {
        " class=\"missed\""
    } else if line.contains(": met") || line.starts_with("PASSED") {
        " class=\"met\""
    } else {
        ""
    }
}

impl Page {
    pub fn html(&self) -> String {
        let mut s = format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n<title>{}</title>\n<style>\n{STYLE}\n</style>\n</head>\n<body>\n<h1>{}</h1>\n",
            esc(&self.title),
            esc(&self.title)
        );
        for m in &self.meta {
            s += &format!("<p class=\"meta\">{}</p>\n", esc(m));
        }
        s += "<nav><ul>\n";
        for sec in &self.sections {
            s += &format!(
                "<li><a href=\"#{}\">{}</a></li>\n",
                esc(&sec.id),
                esc(&sec.title)
            );
        }
        s += "</ul></nav>\n";
        for sec in &self.sections {
            s += &format!(
                "<section id=\"{}\">\n<h2>{}</h2>\n",
                esc(&sec.id),
                esc(&sec.title)
            );
            for b in &sec.blocks {
                match b {
                    Block::Heading(h) => s += &format!("<h3>{}</h3>\n", esc(h)),
                    Block::Para(p) => s += &format!("<p>{}</p>\n", esc(p)),
                    Block::Verdicts(v) => {
                        s += "<ul class=\"verdicts\">\n";
                        for line in v {
                            s += &format!("<li{}>{}</li>\n", verdict_class(line), esc(line));
                        }
                        s += "</ul>\n";
                    }
                    Block::Table(t) => s += &t.html(),
                    Block::Pre(p) => s += &format!("<pre>{}</pre>\n", esc(p)),
                    Block::Figure(f) => {
                        s += &format!(
                            "<figure id=\"fig-{}\">\n{}<figcaption>{} (files: <a href=\"{}.png\">PNG</a>, <a href=\"{}.svg\">SVG</a>)</figcaption>\n</figure>\n",
                            esc(&f.name),
                            f.svg,
                            esc(&f.title),
                            esc(&f.name),
                            esc(&f.name)
                        );
                    }
                }
            }
            s += "</section>\n";
        }
        s + "</body>\n</html>\n"
    }

    pub fn markdown(&self) -> String {
        let mut s = format!("# {}\n\n", self.title);
        for m in &self.meta {
            s += &format!("{m}\n\n");
        }
        for sec in &self.sections {
            s += &format!("## {}\n\n", sec.title);
            for b in &sec.blocks {
                match b {
                    Block::Heading(h) => s += &format!("### {h}\n\n"),
                    Block::Para(p) => s += &format!("{p}\n\n"),
                    Block::Verdicts(v) => {
                        s += "```\n";
                        for line in v {
                            s += &format!("{line}\n");
                        }
                        s += "```\n\n";
                    }
                    Block::Table(t) => s += &format!("{}\n", t.markdown()),
                    Block::Pre(p) => s += &format!("```\n{}\n```\n\n", p.trim_end()),
                    Block::Figure(f) => s += &format!("![{}]({}.png)\n\n", f.title, f.name),
                }
            }
        }
        s
    }

    /// Writes `dir/index.html` and `dir/summary.md`, each through a temporary file renamed
    /// into place; returns their paths.
    pub fn write(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        Ok(vec![
            write_atomic(&dir.join("index.html"), self.html().as_bytes())?,
            write_atomic(&dir.join("summary.md"), self.markdown().as_bytes())?,
        ])
    }
}

/// Writes `path` whole or not at all: a temporary file beside it, renamed over it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!("renaming {} to {}", tmp.display(), path.display())
    })?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_in_html_and_tables_in_markdown() {
        assert_eq!(esc(r#"<script>&"'"#), "&lt;script&gt;&amp;&quot;&#39;");
        let mut t = Table::new(&[("case <x>", false), ("p50", true)]);
        t.push(vec!["a|b".into(), "1 us".into()]);
        let page = Page {
            title: "t & <t>".into(),
            meta: vec!["from <a.json>".into()],
            sections: vec![Section {
                id: "s\"x".into(),
                title: "<b>".into(),
                blocks: vec![
                    Block::Verdicts(vec!["x >= 5x: MISSED <".into()]),
                    Block::Table(t),
                ],
            }],
        };
        let h = page.html();
        assert!(h.contains("<title>t &amp; &lt;t&gt;</title>"), "{h}");
        assert!(
            h.contains("<th>case &lt;x&gt;</th><th class=\"n\">p50</th>"),
            "{h}"
        );
        assert!(
            h.contains("<li class=\"missed\">x &gt;= 5x: MISSED &lt;</li>"),
            "{h}"
        );
        assert!(h.contains("id=\"s&quot;x\""), "{h}");
        assert!(!h.contains("<b>"), "{h}");
        let md = page.markdown();
        assert!(md.contains("| a\\|b | 1 us |"), "{md}");
        assert!(md.contains("|---|---:|"), "{md}");
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("omnirig-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.txt")]);
        assert!(write_atomic(&dir.join("missing/x"), b"").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
