use std::time::Instant;

use data::strip_html;

#[test]
fn strip_html_small_sample() {
    let html = r##"<!DOCTYPE html><html><head><title>T</title><style>p { color: red }</style></head>
<body><nav id="sidebar"><a href="x">Chapter 1</a></nav><div id="menu-bar"><button>Search</button></div>
<main>
  <h1 id="intro"><a class="header" href="#intro">Intro &amp; More</a></h1>
  <p>Use   <code>Vec&lt;T&gt;</code> and
  <em>&quot;quotes&quot;</em> &#39;x&#39; &#65;&#x42; a&nbsp;b.</p>
  <!-- a comment <p>hidden</p> -->
  <script>var x = "<div>";</script>



  <pre><code class="language-rust">fn main() {
    if a &lt; b { println!("hi"); }
}</code></pre>
  <ul><li>one</li><li>two</li></ul>
</main>
<nav class="nav-wrapper">Next chapter</nav>
<template id="fa-eye"><svg><path d="M0"/></svg></template>
</body></html>"##;
    let text = strip_html(html);
    let expect = "Intro & More\n\nUse Vec<T> and \"quotes\" 'x' AB a b.\n\nfn main() {\n    if a < b { println!(\"hi\"); }\n}\n\none\ntwo\n";
    assert_eq!(text, expect);
    // Without <main>, the whole document is used, chrome elements still dropped.
    let t2 = strip_html("<html><body><nav>menu</nav><p>a &lt;b&gt; 3 < 4</p><style>x</style></body></html>");
    assert_eq!(t2, "a <b> 3 < 4\n");
}

#[test]
fn default_corpus_finds_the_rust_books() {
    let t0 = Instant::now();
    let (text, files) = crate::rust_books();
    eprintln!("default corpus: {} files, {} bytes in {:?} (debug build)", files.len(), text.len(), t0.elapsed());
    assert!(files.iter().all(|f| f.ends_with("print.html")));
    assert!(text.len() > 3_000_000, "only {} bytes", text.len());
    for remnant in ["<div", "<span", "</a>", "<h2", "<li>", "class=\"", "href=\"", "&amp;", "&lt;", "&quot;", "\n\n\n"] {
        assert!(!text.contains(remnant), "corpus contains {remnant:?}");
    }
    assert!(text.contains("fn main()"));
    assert!(text.contains("ownership"));
}
