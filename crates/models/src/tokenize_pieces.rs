//! A chat's rendered text tokenised piece by piece, the pieces kept between turns.
//!
//! A tokenizer cuts its added tokens (`<|im_start|>`, `<|im_end|>`, …) out of a text first,
//! leftmost-longest, and tokenises the text between them piece by piece, each alone. So where
//! every added token is cut whole (no whitespace or word rule, not normalised first), a text's
//! ids are its pieces' ids in order, each piece tokenised by itself. A conversation re-sent with
//! one more turn then costs only its new pieces: a 2,000-token history took ~1.4 ms of host time
//! a turn to tokenise again (run g27d), the history's tokens already in the prefix cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use tessera_core::Result;

use crate::tokenize::TextTokenizer;

/// Bytes of pieces and ids kept before the store starts over: a bound on what requests can make
/// it hold.
const MAX_KEPT_BYTES: usize = 8 << 20;

/// Pieces shorter than this are tokenised every time (cheap, and many).
const MIN_KEPT_BYTES: usize = 32;

/// The pieces kept and their bytes.
#[derive(Default)]
struct Kept {
    ids: HashMap<String, Arc<[u32]>>,
    bytes: usize,
}

/// Tokenises text at its added tokens, keeping the pieces' ids (see the module docs).
pub struct PieceTokenizer {
    /// The added tokens and their ids; `None` where the tokenizer does not cut every added token
    /// whole, or a probe disagreed: then every text is tokenised whole.
    cut: Option<(AhoCorasick, Vec<u32>)>,
    kept: Mutex<Kept>,
}

impl PieceTokenizer {
    /// For `tok`: used only where every added token is cut whole and a probe text made of
    /// added tokens and plain text between them tokenises the same both ways.
    pub fn new(tok: &TextTokenizer) -> Self {
        let whole = tok.whole_added_tokens();
        let all_whole = !whole.is_empty() && whole.len() == tok.added_token_count();
        let (texts, ids): (Vec<String>, Vec<u32>) = whole.into_iter().unzip();
        let cut = all_whole
            .then(|| {
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&texts)
                    .ok()
            })
            .flatten()
            .map(|ac| (ac, ids));
        let p = PieceTokenizer {
            cut,
            kept: Mutex::default(),
        };
        // The probe's plain pieces are all shorter than MIN_KEPT_BYTES: nothing is kept.
        let probe = probe_text(&texts);
        match (p.encode(tok, &probe), tok.encode_plain(&probe)) {
            (Ok(a), Ok(b)) if a == b => p,
            _ => PieceTokenizer {
                cut: None,
                kept: Mutex::default(),
            },
        }
    }

    /// Whether texts are cut at added tokens (else tokenised whole).
    #[cfg(test)]
    pub(crate) fn cuts(&self) -> bool {
        self.cut.is_some()
    }

    /// The ids of `text` as `tok.encode_plain(text)` gives them.
    pub fn encode(&self, tok: &TextTokenizer, text: &str) -> Result<Vec<u32>> {
        let Some((ac, ids)) = &self.cut else {
            return tok.encode_plain(text);
        };
        let mut out = Vec::new();
        let mut at = 0;
        for m in ac.find_iter(text) {
            self.piece(tok, &text[at..m.start()], &mut out)?;
            out.push(ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.piece(tok, &text[at..], &mut out)?;
        Ok(out)
    }

    /// Append the ids of `piece` (text without added tokens), kept or tokenised.
    fn piece(&self, tok: &TextTokenizer, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_KEPT_BYTES {
            out.extend(tok.encode_plain(piece)?);
            return Ok(());
        }
        let hit = self
            .kept
            .lock()
            .ok()
            .and_then(|k| k.ids.get(piece).cloned());
        if let Some(ids) = hit {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let ids: Arc<[u32]> = tok.encode_plain(piece)?.into();
        out.extend_from_slice(&ids);
        if let Ok(mut k) = self.kept.lock() {
            let bytes = piece.len() + 4 * ids.len();
            if k.bytes + bytes > MAX_KEPT_BYTES {
                *k = Kept::default();
            }
            if bytes <= MAX_KEPT_BYTES && k.ids.insert(piece.to_string(), ids).is_none() {
                k.bytes += bytes;
            }
        }
        Ok(())
    }

    /// Pieces kept and their bytes.
    #[cfg(test)]
    fn kept(&self) -> (usize, usize) {
        self.kept
            .lock()
            .map(|k| (k.ids.len(), k.bytes))
            .unwrap_or_default()
    }
}

/// A text holding each added token of `tokens` (up to 64 of them) between bits of plain text,
/// with whitespace on both sides of some.
fn probe_text(tokens: &[String]) -> String {
    let mut s = String::from("Hello there ");
    for (i, t) in tokens.iter().take(64).enumerate() {
        s.push_str(t);
        s.push_str(["\n", " word ", "x", "\n\n  ", ""][i % 5]);
    }
    s.push_str(" the end.");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelFiles;
    use crate::lfm2vl::{BUNDLED, Lfm2VlConfig};

    fn bundled() -> TextTokenizer {
        let cfg = Lfm2VlConfig::read(&BUNDLED).unwrap();
        TextTokenizer::load(&BUNDLED, (cfg.text.bos, cfg.text.eos.first().copied())).unwrap()
    }

    /// Texts a chat template writes and some it might: markers back to back, inside words,
    /// with whitespace either side, broken ones, long runs of plain text.
    fn texts() -> Vec<String> {
        let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
        vec![
            format!("<|startoftext|><|im_start|>user\n{long}<|im_end|>\n<|im_start|>assistant\n"),
            format!(
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{long}?<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
            ),
            "<|im_end|><|im_start|><|im_end|>".into(),
            "word<|im_end|>word  <|im_start|>  x".into(),
            "<|im_ <|im_endd|> <im_end|> |im_end|>".into(),
            format!("  leading and trailing {long}  "),
            "ünïcödé ☃ 漢字 <|im_start|>emoji 🙂".into(),
            String::new(),
        ]
    }

    #[test]
    fn pieces_give_the_whole_texts_ids_and_are_kept() {
        let tok = bundled();
        let p = PieceTokenizer::new(&tok);
        assert!(
            p.cuts(),
            "the bundled tokenizer's added tokens are all whole"
        );
        for t in texts() {
            assert_eq!(
                p.encode(&tok, &t).unwrap(),
                tok.encode_plain(&t).unwrap(),
                "{t:?}"
            );
        }
        // Again: the long pieces come from the store, with the same ids, and none is added.
        let kept = p.kept();
        assert!(kept.0 >= 3, "{kept:?}");
        for t in texts() {
            assert_eq!(
                p.encode(&tok, &t).unwrap(),
                tok.encode_plain(&t).unwrap(),
                "{t:?}"
            );
        }
        assert_eq!(p.kept(), kept);
    }

    #[test]
    fn the_store_is_bounded() {
        let tok = bundled();
        let p = PieceTokenizer::new(&tok);
        let piece = "x".repeat(64 << 10);
        for i in 0..200 {
            let t = format!("{i}{piece}<|im_end|>");
            p.encode(&tok, &t).unwrap();
            assert!(p.kept().1 <= MAX_KEPT_BYTES, "{:?}", p.kept());
        }
    }

    #[test]
    fn a_tokenizer_with_a_stripping_added_token_tokenises_whole_texts() {
        let mut json: serde_json::Value =
            serde_json::from_str(&BUNDLED.read("tokenizer.json").unwrap()).unwrap();
        json["added_tokens"][3]["rstrip"] = true.into();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        let tok = TextTokenizer::load(
            &ModelFiles::Dir(dir.path().to_path_buf()),
            (Some(1), Some(2)),
        )
        .unwrap();
        let p = PieceTokenizer::new(&tok);
        assert!(!p.cuts());
        for t in texts() {
            assert_eq!(
                p.encode(&tok, &t).unwrap(),
                tok.encode_plain(&t).unwrap(),
                "{t:?}"
            );
        }
    }
}
