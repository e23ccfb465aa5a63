//! Task prompts from `config_sentence_transformers.json` (`"prompts": {name: prefix}`).
//!
//! sentence-transformers prepends the prefix string to the text before tokenising; no prompt is
//! applied unless asked for (the release file sets no default).

use std::collections::BTreeMap;

use serde::Deserialize;
use tessera_core::{Error, Result};

use crate::files::ModelFiles;

#[derive(Clone, Debug, Default)]
pub struct Prompts {
    table: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct StConfig {
    #[serde(default)]
    prompts: BTreeMap<String, String>,
}

impl Prompts {
    pub const FILE: &'static str = "config_sentence_transformers.json";

    /// The model's prompt table; empty when the file is absent.
    pub fn load(files: &ModelFiles) -> Result<Self> {
        let Some(text) = files.read_optional(Self::FILE)? else {
            return Ok(Prompts::default());
        };
        let st: StConfig = tessera_core::config::parse_json(&files.path(Self::FILE), &text)?;
        Ok(Prompts { table: st.prompts })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.table.keys().map(String::as_str)
    }

    /// The prefix for `name`, or an error listing the known names.
    pub fn get(&self, name: &str) -> Result<&str> {
        self.table.get(name).map(String::as_str).ok_or_else(|| {
            let known: Vec<&str> = self.names().collect();
            Error::input(if known.is_empty() {
                format!("unknown prompt name {name:?}: this model defines no prompts ({} is missing or empty)", Self::FILE)
            } else {
                format!("unknown prompt name {name:?}; known: {}", known.join(", "))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_name_lists_known() {
        let p = Prompts {
            table: [
                ("query".to_string(), "q: ".to_string()),
                ("document".to_string(), "d: ".to_string()),
            ]
            .into(),
        };
        assert_eq!(p.get("query").unwrap(), "q: ");
        let e = p.get("Query").unwrap_err().to_string();
        assert!(
            e.contains("\"Query\"") && e.contains("document, query"),
            "{e}"
        );
        let e = Prompts::default().get("x").unwrap_err().to_string();
        assert!(e.contains("defines no prompts"), "{e}");
    }
}
