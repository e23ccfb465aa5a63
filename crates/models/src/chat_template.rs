//! Chat templates as Hugging Face tokenizers ship them (`chat_template.jinja`, or `chat_template`
//! in `tokenizer_config.json`), rendered the way transformers' `apply_chat_template(...,
//! tokenize=False)` renders them: Jinja with `trim_blocks` and `lstrip_blocks`, loop controls,
//! Python's string and dict methods, `raise_exception`, a `tojson` that writes what Python's
//! `json.dumps` writes, and the tokenizer's special tokens (`bos_token`, `eos_token`, …) as
//! variables. A model whose checkpoint ships its own template (a fine-tune, a default system
//! prompt, other whitespace control) gets the prompt its reference gets.

use std::collections::BTreeMap;
use std::path::PathBuf;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use tessera_core::{Error, Result};

use crate::ModelFiles;

/// The template's name inside an [`Environment`].
const NAME: &str = "chat_template";

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
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.path, &e))?;
        template
            .render(vars)
            .map_err(|e| template_error(&self.path, &e))
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
