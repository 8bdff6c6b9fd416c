//! Chat templates: a tokenizer's `chat_template` (Jinja) rendered as transformers'
//! `apply_chat_template` renders it (jinja2 with `trim_blocks` and `lstrip_blocks`, the context
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`), through
//! `minijinja` with Python's string methods (`pycompat`). The assistant turns are found by
//! rendering the conversation prefix by prefix: turn `i` is the text between the rendering of
//! `messages[..i]` with the generation prompt and that of `messages[..=i]`.

use std::ops::Range;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, Value as JValue};
use serde_json::Value;

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos: String,
    eos: String,
}

const NAME: &str = "chat_template";

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)` (minijinja's own
/// escapes `<`, `>`, `&` and `'` for HTML, which a chat template does not want).
fn tojson(v: JValue, indent: Option<usize>) -> Result<String, minijinja::Error> {
    let j: Value = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let out = match indent {
        None => serde_json::to_string(&j),
        Some(n) => {
            let ind = " ".repeat(n);
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(ind.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            serde::Serialize::serialize(&j, &mut ser).map(|_| String::from_utf8(buf).unwrap_or_default())
        }
    };
    // Python's separators are ", " and ": " without indent.
    out.map(|s| if indent.is_none() { python_separators(&s) } else { s }).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `,` → `, ` and `:` → `: ` outside strings (serde_json's compact form to Python's default).
fn python_separators(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    let (mut in_str, mut esc) = (false, false);
    for c in s.chars() {
        out.push(c);
        if in_str {
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
        } else if c == ',' || c == ':' {
            out.push(' ');
        }
    }
    out
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the tokens' strings the template may print.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false).build().map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> { Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_template_owned(NAME, source.to_string()).map_err(|e| format!("chat_template does not compile: {e}"))?;
        Ok(ChatTemplate { env: Arc::new(env), bos: bos.into(), eos: eos.into() })
    }

    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=…)`.
    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String, String> {
        let t = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let ctx = minijinja::context! {
            messages => JValue::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        t.render(ctx).map_err(|e| format!("chat_template failed: {e}"))
    }

    /// The whole conversation rendered, and the byte ranges of its assistant turns in it.
    pub fn render_spans(&self, messages: &Value) -> Result<(String, Vec<Range<usize>>), String> {
        self.render_spans_from(messages, 0)
    }

    /// [`ChatTemplate::render_spans`] with only the assistant turns from message `from` on.
    pub fn render_spans_from(&self, messages: &Value, from: usize) -> Result<(String, Vec<Range<usize>>), String> {
        let list = messages.as_array().ok_or("messages is not an array")?;
        let full = self.render(list, false)?;
        let mut spans = Vec::new();
        for (i, m) in list.iter().enumerate() {
            if i < from || m["role"] != "assistant" {
                continue;
            }
            let before = self.render(&list[..i], true)?;
            let upto = self.render(&list[..=i], false)?;
            if !upto.starts_with(&before) || !full.starts_with(&upto) {
                return Err(format!(
                    "the chat template does not render conversations prefix by prefix (messages[{i}], the assistant turn, cannot be located), so the assistant tokens cannot be found"
                ));
            }
            if upto.len() > before.len() {
                spans.push(before.len()..upto.len());
            }
        }
        Ok((full, spans))
    }
}
