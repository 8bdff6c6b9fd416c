//! The default corpus: the Rust books every rustup install carries (`rust-docs` component),
//! as plain text via [`strip_html`].

use std::path::{Path, PathBuf};

use crate::error::DataError;

/// The books, under `<sysroot>/share/doc/rust/html/<book>/print.html`, in corpus order.
pub const DEFAULT_BOOKS: [&str; 7] = ["book", "reference", "nomicon", "rust-by-example", "cargo", "edition-guide", "embedded-book"];

/// Elements whose content is chrome, not text.
const SKIP: [&str; 11] = ["script", "style", "nav", "noscript", "template", "svg", "head", "title", "button", "iframe", "select"];
/// Elements that separate paragraphs.
const BLOCK: [&str; 25] = [
    "p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "dl", "table", "blockquote", "section", "figure", "main",
    "article", "header", "footer", "pre", "hr", "aside", "details", "summary", "body",
];
/// Elements that end a line.
const LINE: [&str; 6] = ["br", "li", "tr", "dt", "dd", "figcaption"];

fn candidate_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    if let Ok(out) = std::process::Command::new(rustc).args(["--print", "sysroot"]).output() {
        if out.status.success() {
            let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !s.is_empty() {
                roots.push(PathBuf::from(s));
            }
        }
    }
    let mut homes = Vec::new();
    if let Some(h) = std::env::var_os("RUSTUP_HOME") {
        homes.push(PathBuf::from(h));
    }
    if let Some(h) = std::env::var_os("HOME") {
        homes.push(Path::new(&h).join(".rustup"));
    }
    for h in homes {
        if let Ok(rd) = std::fs::read_dir(h.join("toolchains")) {
            let mut tcs: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            tcs.sort();
            roots.extend(tcs);
        }
    }
    roots.dedup();
    roots
}

/// The `print.html` files of [`DEFAULT_BOOKS`] under the first toolchain that has any, or an
/// error listing what was looked for.
pub fn default_corpus_files() -> Result<Vec<PathBuf>, DataError> {
    let roots = candidate_roots();
    for root in &roots {
        let html = root.join("share/doc/rust/html");
        let found: Vec<PathBuf> =
            DEFAULT_BOOKS.iter().map(|b| html.join(b).join("print.html")).filter(|p| p.is_file()).collect();
        if !found.is_empty() {
            return Ok(found);
        }
    }
    let looked: Vec<String> = roots.iter().map(|r| r.join("share/doc/rust/html").display().to_string()).collect();
    Err(DataError::new(format!(
        "default corpus not found: looked for {{{}}}/print.html under [{}]; install the docs with `rustup component add rust-docs`, or pass --data PATH",
        DEFAULT_BOOKS.join(","),
        if looked.is_empty() { "no Rust sysroot or rustup toolchain found".to_string() } else { looked.join(", ") }
    )))
}

/// The default corpus text (books joined with blank lines) and the files it came from.
pub fn default_corpus() -> Result<(String, Vec<PathBuf>), DataError> {
    let files = default_corpus_files()?;
    let mut text = String::new();
    for f in &files {
        let bytes = std::fs::read(f).map_err(|e| DataError::io(f, "cannot read", e))?;
        let html = String::from_utf8_lossy(&bytes);
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(strip_html(&html).trim());
    }
    Ok((text, files))
}

fn find_ci(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| hay[i..i + needle.len()].eq_ignore_ascii_case(needle))
}

fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    if from > hay.len() || hay.len() < needle.len() {
        return None;
    }
    hay[from..].windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// End (exclusive, after `>`) of the tag starting at `i`, respecting quoted attributes.
fn tag_end(b: &[u8], mut i: usize) -> usize {
    let mut quote = 0u8;
    while i < b.len() {
        let c = b[i];
        if quote != 0 {
            if c == quote {
                quote = 0;
            }
        } else if c == b'"' || c == b'\'' {
            quote = c;
        } else if c == b'>' {
            return i + 1;
        }
        i += 1;
    }
    b.len()
}

fn push_breaks(out: &mut String, n: usize) {
    while out.ends_with(' ') {
        out.pop();
    }
    if out.is_empty() {
        return;
    }
    let have = out.len() - out.trim_end_matches('\n').len();
    for _ in have..n {
        out.push('\n');
    }
}

/// Decodes the entity at `s` (which starts with `&`): `(text, bytes consumed)`.
fn entity(s: &str) -> Option<(char, usize)> {
    let end = s.as_bytes().iter().take(12).position(|&c| c == b';')?;
    let name = &s[1..end];
    let c = match name {
        "amp" => '&',
        "lt" => '<',
        "gt" => '>',
        "quot" => '"',
        "apos" => '\'',
        "nbsp" => ' ',
        "mdash" => '—',
        "ndash" => '–',
        "hellip" => '…',
        "rsquo" => '’',
        "lsquo" => '‘',
        "rdquo" => '”',
        "ldquo" => '“',
        "copy" => '©',
        _ => {
            let num = name.strip_prefix('#')?;
            let v = match num.strip_prefix(['x', 'X']) {
                Some(h) => u32::from_str_radix(h, 16).ok()?,
                None => num.parse::<u32>().ok()?,
            };
            char::from_u32(v).unwrap_or(char::REPLACEMENT_CHARACTER)
        }
    };
    Some((c, end + 1))
}

/// HTML to plain text: keeps only `<main>` when there is one (mdBook's page body, without the
/// sidebar, menu bar and navigation); drops script/style/nav/svg/... content and comments;
/// block elements become blank lines, `<br>`/`<li>`/`<tr>` line breaks; whitespace collapses
/// outside `<pre>`; entities are decoded; runs of blank lines collapse to one.
pub fn strip_html(html: &str) -> String {
    let body = match (find_ci(html.as_bytes(), 0, b"<main"), find_ci(html.as_bytes(), 0, b"</main>")) {
        (Some(s), Some(e)) if s < e => &html[s..e + "</main>".len()],
        _ => html,
    };
    let b = body.as_bytes();
    let n = b.len();
    let mut out = String::with_capacity(n / 2);
    let mut pre = 0usize;
    let mut i = 0;
    while i < n {
        let c = b[i];
        if c == b'<' {
            if b[i..].starts_with(b"<!--") {
                i = find(b, i + 4, b"-->").map_or(n, |e| e + 3);
                continue;
            }
            if b.get(i + 1).is_some_and(|&d| d == b'!' || d == b'?') {
                i = tag_end(b, i + 1);
                continue;
            }
            let closing = b.get(i + 1) == Some(&b'/');
            let ns = i + 1 + closing as usize;
            let mut ne = ns;
            while ne < n && (b[ne].is_ascii_alphanumeric() || b[ne] == b'-') {
                ne += 1;
            }
            if ne == ns || !b[ns].is_ascii_alphabetic() {
                // A bare '<' in text.
                push_text(&mut out, "<", pre > 0);
                i += 1;
                continue;
            }
            let name = body[ns..ne].to_ascii_lowercase();
            let end = tag_end(b, ne);
            let self_closing = end >= 2 && b[end - 2] == b'/';
            i = end;
            if !closing && !self_closing && SKIP.contains(&name.as_str()) {
                let close = format!("</{name}");
                i = find_ci(b, i, close.as_bytes()).map_or(n, |e| tag_end(b, e));
                continue;
            }
            if name == "pre" {
                if closing {
                    pre = pre.saturating_sub(1);
                } else {
                    pre += 1;
                }
            }
            if BLOCK.contains(&name.as_str()) {
                push_breaks(&mut out, 2);
            } else if LINE.contains(&name.as_str()) {
                push_breaks(&mut out, 1);
            } else if (name == "td" || name == "th") && !closing && !out.ends_with('\n') && !out.is_empty() {
                out.push(' ');
            }
            continue;
        }
        if c == b'&' {
            if let Some((ch, used)) = entity(&body[i..]) {
                let mut buf = [0u8; 4];
                push_text(&mut out, ch.encode_utf8(&mut buf), pre > 0);
                i += used;
                continue;
            }
        }
        // A run of plain text up to the next '<' or '&'.
        let mut j = i + 1;
        while j < n && b[j] != b'<' && b[j] != b'&' {
            j += 1;
        }
        push_text(&mut out, &body[i..j], pre > 0);
        i = j;
    }
    collapse_blank_lines(&out)
}

fn push_text(out: &mut String, s: &str, in_pre: bool) {
    if in_pre {
        out.push_str(s);
        return;
    }
    for ch in s.chars() {
        if ch.is_ascii_whitespace() {
            if !(out.is_empty() || out.ends_with(' ') || out.ends_with('\n')) {
                out.push(' ');
            }
        } else {
            out.push(ch);
        }
    }
}

fn collapse_blank_lines(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut blank_run = 0;
    for line in s.split('\n') {
        let line = line.trim_end();
        if line.is_empty() {
            blank_run += 1;
            if blank_run > 1 {
                continue;
            }
        } else {
            blank_run = 0;
        }
        out.push_str(line);
        out.push('\n');
    }
    let t = out.trim_matches('\n');
    t.to_string() + "\n"
}
