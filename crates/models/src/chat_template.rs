//! Chat templates as Hugging Face tokenizers ship them (`chat_template.jinja`, or `chat_template`
//! in `tokenizer_config.json`), rendered the way transformers' `apply_chat_template(...,
//! tokenize=False)` renders them: Jinja with `trim_blocks` and `lstrip_blocks`, loop controls,
//! Python's string and dict methods, `raise_exception`, a `tojson` that writes what Python's
//! `json.dumps` writes, and the tokenizer's special tokens (`bos_token`, `eos_token`, …) as
//! variables. A model whose checkpoint ships its own template (a fine-tune, a default system
//! prompt, other whitespace control) gets the prompt its reference gets.
//!
//! A template comes with the checkpoint, so it is untrusted input: a few lines of Jinja can
//! double a string forty times or loop for hours. Every render runs on a budget ([`Budget`]):
//! minijinja's fuel (instructions, and the bytes the template makes) and a cap on the text it
//! writes, both scaled to the conversation's size, so a hostile template fails in milliseconds
//! with an error naming its file instead of exhausting memory or a worker thread.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use tessera_core::{Error, Result};

use crate::ModelFiles;

/// The template's name inside an [`Environment`].
const NAME: &str = "chat_template";

/// What one render may spend: minijinja's fuel (about one unit per instruction and per 64 bytes
/// the template makes) and the bytes it may write, each a fixed allowance plus a share per byte
/// of the conversation. Real templates use a few thousand units and write their input plus a
/// few hundred bytes per turn; the allowances leave two orders of magnitude of headroom while
/// bounding a hostile template to about 100 ms and some tens of MiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub fuel: u64,
    pub output_bytes: usize,
}

impl Budget {
    /// Fuel for any conversation: about a million instructions, or 64 MiB made.
    const FUEL_BASE: u64 = 1_000_000;
    /// Fuel per byte of conversation: each byte may be copied, sliced and written a few times.
    const FUEL_PER_BYTE: u64 = 1;
    /// Output for any conversation.
    const OUTPUT_BASE: usize = 1 << 20;
    /// Output per byte of conversation (a template may repeat a turn, JSON-escape it, …).
    const OUTPUT_PER_BYTE: usize = 4;

    /// The budget for a conversation of `input_bytes` bytes of text.
    pub fn for_input(input_bytes: usize) -> Self {
        Budget {
            fuel: Self::FUEL_BASE
                .saturating_add((input_bytes as u64).saturating_mul(Self::FUEL_PER_BYTE)),
            output_bytes: Self::OUTPUT_BASE
                .saturating_add(input_bytes.saturating_mul(Self::OUTPUT_PER_BYTE)),
        }
    }
}

/// One turn of a conversation.
#[derive(Clone, Debug, Serialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// What a turn says: plain text, or a list of parts (text and images) as the multimodal
/// processors pass it (`[{"type": "image"}, {"type": "text", "text": "…"}]`).
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a multimodal turn.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text { text: String },
    Image,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: Content::Text(content.into()),
        }
    }

    /// A turn of text and image parts, in order.
    pub fn parts(role: &str, parts: Vec<Part>) -> Self {
        Message {
            role: role.into(),
            content: Content::Parts(parts),
        }
    }

    /// Bytes of text in this turn (role and every text part), what a template's budget scales
    /// with.
    pub fn text_bytes(&self) -> usize {
        self.role.len()
            + match &self.content {
                Content::Text(t) => t.len(),
                Content::Parts(p) => p
                    .iter()
                    .map(|p| match p {
                        Part::Text { text } => text.len(),
                        Part::Image => 0,
                    })
                    .sum(),
            }
    }

    /// Characters of text in this turn's content (its text parts), what a prompt's length is
    /// first judged by.
    pub fn text_chars(&self) -> usize {
        match &self.content {
            Content::Text(t) => t.chars().count(),
            Content::Parts(p) => p
                .iter()
                .map(|p| match p {
                    Part::Text { text } => text.chars().count(),
                    Part::Image => 0,
                })
                .sum(),
        }
    }

    /// Images among this turn's parts.
    pub fn images(&self) -> usize {
        match &self.content {
            Content::Text(_) => 0,
            Content::Parts(p) => p.iter().filter(|p| matches!(p, Part::Image)).count(),
        }
    }
}

/// A compiled chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for messages.
    path: PathBuf,
    /// `bos_token`, `eos_token`, … from `tokenizer_config.json`.
    specials: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Special-token attributes transformers passes to the template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl ChatTemplate {
    /// The template a tokenizer folder ships: `chat_template.jinja`, else the `chat_template`
    /// entry of `tokenizer_config.json` (a string, or a list of named templates of which the
    /// one named `default` is used, as transformers does). `None` when there is neither.
    pub fn load(files: &ModelFiles) -> Result<Option<Self>> {
        let path = files.path("tokenizer_config.json");
        let config: Option<serde_json::Value> = files
            .read_optional("tokenizer_config.json")?
            .map(|text| tessera_core::config::parse_json(&path, &text))
            .transpose()?;
        let specials = config.as_ref().map(special_tokens).unwrap_or_default();
        if let Some(source) = files.read_optional("chat_template.jinja")? {
            return Self::new(&source, files.path("chat_template.jinja"), specials).map(Some);
        }
        let source = match config.as_ref().and_then(|c| c.get("chat_template")) {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| {
                    Error::config(
                        &path,
                        "chat_template",
                        "a list of named templates without one named \"default\"".to_string(),
                    )
                })?
                .to_string(),
            Some(_) => {
                return Err(Error::config(
                    &path,
                    "chat_template",
                    "neither a string nor a list of named templates".to_string(),
                ));
            }
        };
        Self::new(&source, path, specials).map(Some)
    }

    /// Compile `source` (read from `path`, named in errors).
    pub fn new(source: &str, path: PathBuf, specials: BTreeMap<String, String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&path, &e))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| template_error(&path, &e))?;
        Ok(ChatTemplate {
            env,
            path,
            specials,
        })
    }

    /// Where the template was read from.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The text for `messages`, as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=…, **extra)` gives it: `tools` and `documents` are none, the special
    /// tokens and `extra` (such as `enable_thinking`) are variables.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &[(&str, Value)],
    ) -> Result<String> {
        let mut vars: BTreeMap<String, Value> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        for (k, v) in extra {
            vars.insert(k.to_string(), v.clone());
        }
        vars.insert("messages".into(), Value::from(Serde(messages)));
        vars.insert("tools".into(), Value::from(()));
        vars.insert("documents".into(), Value::from(()));
        vars.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let input: usize = messages.iter().map(|m| m.text_bytes() + 32).sum::<usize>()
            + extra
                .iter()
                .map(|(k, v)| k.len() + v.to_string().len())
                .sum::<usize>();
        self.render_within(vars, Budget::for_input(input))
    }

    /// Render with `vars` on `budget`: fuel set on a copy of the environment (a cheap clone of
    /// shared tables) and the output written through a writer that refuses to grow past the
    /// cap, so neither a long loop nor a growing string outlives its budget.
    fn render_within(&self, vars: BTreeMap<String, Value>, budget: Budget) -> Result<String> {
        let mut env = self.env.clone();
        env.set_fuel(Some(budget.fuel));
        let template = env
            .get_template(NAME)
            .map_err(|e| template_error(&self.path, &e))?;
        let mut out = Capped {
            bytes: Vec::new(),
            cap: budget.output_bytes,
            over: false,
        };
        let rendered = template.render_captured_to(vars, &mut out);
        match rendered {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(Error::input(format!(
                    "chat template {}: the template ran out of its budget ({} units of work; \
                     a checkpoint's template is untrusted and must not loop or grow without bound)",
                    self.path.display(),
                    budget.fuel
                )));
            }
            Err(_) if out.over => {
                return Err(Error::input(format!(
                    "chat template {}: the template wrote more than {} bytes for this \
                     conversation (its limit)",
                    self.path.display(),
                    budget.output_bytes
                )));
            }
            Err(e) => return Err(template_error(&self.path, &e)),
        }
        String::from_utf8(out.bytes).map_err(|_| {
            Error::input(format!(
                "chat template {}: the output is not UTF-8",
                self.path.display()
            ))
        })
    }
}

/// The rendered text, refused once it would pass `cap` bytes.
struct Capped {
    bytes: Vec<u8>,
    cap: usize,
    /// A write was refused for the cap.
    over: bool,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.cap {
            self.over = true;
            return Err(std::io::Error::other(
                "the template's output is over its cap",
            ));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The special tokens of a `tokenizer_config.json`: each a string or an added-token object with
/// its `content`.
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|&name| {
            let v = config.get(name)?;
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            Some((name.to_string(), text.to_string()))
        })
        .collect()
}

fn template_error(path: &std::path::Path, e: &minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::input(format!("chat template {}: {msg}", path.display()))
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("the template raised: {message}"),
    ))
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ));
        }
        // Python's defaults: ", " inline, "," when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays out its output.
struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ascii: bool,
}

impl JsonStyle {
    fn write(
        &self,
        v: &Value,
        depth: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&python_number(v)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', depth, out, &items, |s, item, out| {
                    s.write(item, depth + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                let pairs: Vec<(Value, Value)> = keys
                    .into_iter()
                    .map(|k| {
                        let item = v.get_item(&k)?;
                        Ok((k, item))
                    })
                    .collect::<std::result::Result<_, minijinja::Error>>()?;
                self.container('{', '}', depth, out, &pairs, |s, (k, item), out| {
                    match k.as_str() {
                        Some(k) => s.string(k, out),
                        None => s.string(&k.to_string(), out),
                    }
                    out.push_str(&s.key);
                    s.write(item, depth + 1, out)
                })?;
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialise a {}", v.kind()),
                ));
            }
        }
        Ok(())
    }

    /// `open items close`, each item on its own indented line when indenting.
    fn container<T>(
        &self,
        open: char,
        close: char,
        depth: usize,
        out: &mut String,
        items: &[T],
        mut each: impl FnMut(&Self, &T, &mut String) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * level));
            }
        };
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            each(self, item, out)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python escapes it.
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `json.dumps` writes it: integers as they are, floats as `repr` writes
/// them (`2.0`, `0.0001`, `1e-05`, `1.5e+16`; `NaN` and `Infinity` as Python allows them).
fn python_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let Ok(f) = f64::try_from(v.clone()) else {
        return v.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Both print the shortest digits that read back as `f`; Python switches to an exponent
    // below 1e-4 and from 1e16.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = f.to_string();
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let specials = BTreeMap::from([("eos_token".to_string(), "<|endoftext|>".to_string())]);
        ChatTemplate::new(source, "t.jinja".into(), specials).unwrap()
    }

    fn user(text: &str) -> Vec<Message> {
        vec![Message::new("user", text)]
    }

    // The expected strings are what transformers 5.25's compiled templates render for the same
    // sources and variables (checked with `_compile_jinja_template`).

    #[test]
    fn trims_blocks_and_strips_their_indentation_like_transformers() {
        let t = template(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}",
        );
        assert_eq!(t.render(&user("hi"), true, &[]).unwrap(), "<hi>\nA:");
        assert_eq!(t.render(&user("hi"), false, &[]).unwrap(), "<hi>\n");
    }

    #[test]
    fn python_methods_special_tokens_and_extra_variables() {
        let t = template(
            "{{ messages[0].content.strip().upper() }}|{{ messages[-1]['role'] }}|{{ eos_token }}|{% if enable_thinking is defined and enable_thinking is false %}no{% else %}think{% endif %}|{{ tools is none }}",
        );
        let got = t
            .render(
                &user("  hey "),
                true,
                &[("enable_thinking", Value::from(false))],
            )
            .unwrap();
        // Booleans print as Python prints them, as under Jinja2.
        assert_eq!(got, "HEY|user|<|endoftext|>|no|True");
        let got = t.render(&user("x"), true, &[]).unwrap();
        assert!(got.ends_with("|think|True"), "{got}");
    }

    #[test]
    fn multimodal_parts_render_as_lists_of_typed_items() {
        let t = template(
            "{% for m in messages %}{% for p in m.content %}{% if p.type == 'image' %}<image>\
             {% else %}{{ p.text }}{% endif %}{% endfor %}{% endfor %}",
        );
        let m = Message::parts(
            "user",
            vec![
                Part::Image,
                Part::Text {
                    text: "What is this?".into(),
                },
            ],
        );
        assert_eq!(m.images(), 1);
        assert_eq!(t.render(&[m], false, &[]).unwrap(), "<image>What is this?");
    }

    #[test]
    fn loop_controls_and_namespaces_work() {
        let t = template(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
        );
        let msgs = [
            Message::new("system", "s"),
            Message::new("user", "u"),
            Message::new("assistant", "a"),
        ];
        assert_eq!(t.render(&msgs, false, &[]).unwrap(), "2");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = template("{{ messages[0] | tojson }}");
        assert_eq!(
            t.render(&user("é \"q\" <b>\n"), false, &[]).unwrap(),
            r#"{"role": "user", "content": "é \"q\" <b>\n"}"#
        );
        let t = template("{{ x | tojson(indent=2) }}");
        let x = Value::from(Serde(
            serde_json::json!({"a": [1, 2.0, null, true], "b": {}}),
        ));
        assert_eq!(
            t.render(&[], false, &[("x", x)]).unwrap(),
            "{\n  \"a\": [\n    1,\n    2.0,\n    null,\n    true\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn numbers_are_written_as_python_writes_them() {
        let t = template("{{ x | tojson }}");
        let x = Value::from(Serde(serde_json::json!([
            0, -3, 2.0, -0.0, 0.1, 0.0001, 0.00001, 1.5e-7, 1e15, 1e16, 1.5e16, 123456.789
        ])));
        assert_eq!(
            t.render(&[], false, &[("x", x)]).unwrap(),
            "[0, -3, 2.0, -0.0, 0.1, 0.0001, 1e-05, 1.5e-07, 1000000000000000.0, 1e+16, 1.5e+16, 123456.789]"
        );
    }

    /// Before the budget: the doubling string aborted the process ("memory allocation of
    /// 2147483664 bytes failed") and the nested loops ran for hours.
    #[test]
    fn a_hostile_template_runs_out_of_its_budget_quickly_and_is_named() {
        for source in [
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "{% macro m(n) %}{{ m(n) }}{{ m(n) }}{% endmacro %}{{ m(1) }}",
        ] {
            let started = std::time::Instant::now();
            let e = template(source)
                .render(&user("hi"), true, &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("t.jinja"), "{source}: {e}");
            assert!(
                started.elapsed() < std::time::Duration::from_secs(5),
                "{source}: {:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn the_output_cap_refuses_a_template_that_writes_too_much() {
        let t = template("{% for m in messages %}{{ m.content }}{% endfor %}");
        let vars = BTreeMap::from([(
            "messages".to_string(),
            Value::from(Serde(vec![Message::new("user", &"x".repeat(1000))])),
        )]);
        let budget = Budget {
            fuel: 1_000_000,
            output_bytes: 999,
        };
        let e = t
            .render_within(vars.clone(), budget)
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.jinja") && e.contains("999 bytes"), "{e}");
        let budget = Budget {
            output_bytes: 1000,
            ..budget
        };
        assert_eq!(t.render_within(vars, budget).unwrap().len(), 1000);
    }

    #[test]
    fn the_budget_grows_with_the_conversation() {
        // A long but honest conversation renders whole.
        let t = template("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}");
        let long = "word ".repeat(400_000);
        let got = t.render(&user(&long), true, &[]).unwrap();
        assert_eq!(got.len(), "<user>".len() + long.trim().len());
        assert!(Budget::for_input(1 << 20).fuel > Budget::for_input(0).fuel);
    }

    #[test]
    fn raise_exception_and_syntax_errors_name_the_file() {
        let t = template("{{ raise_exception('only user turns') }}");
        let e = t.render(&user("x"), false, &[]).unwrap_err().to_string();
        assert!(
            e.contains("t.jinja") && e.contains("only user turns"),
            "{e}"
        );
        let e = ChatTemplate::new("{% for %}", "bad.jinja".into(), BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.jinja"), "{e}");
    }

    #[test]
    fn loads_from_the_jinja_file_or_the_config_entry() {
        let dir = tempfile::tempdir().unwrap();
        let files = ModelFiles::Dir(dir.path().to_path_buf());
        assert!(ChatTemplate::load(&files).unwrap().is_none());
        let config = serde_json::json!({
            "eos_token": {"content": "<e>", "special": true},
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::load(&files).unwrap().unwrap();
        assert_eq!(t.render(&[], false, &[]).unwrap(), "D<e>");
        std::fs::write(dir.path().join("chat_template.jinja"), "J").unwrap();
        let t = ChatTemplate::load(&files).unwrap().unwrap();
        assert_eq!(t.render(&[], false, &[]).unwrap(), "J");
        assert!(t.path().ends_with("chat_template.jinja"));
    }
}
