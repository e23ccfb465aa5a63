//! Generated tokens to streamed text: pieces are handed out as soon as they are whole UTF-8
//! (a character split over byte tokens waits for its last byte) and never include a stop
//! string or the start of one that may still complete.

use tessera_core::Result;

/// Incremental detokenisation with stop strings.
pub struct TextStream {
    ids: Vec<u32>,
    stops: Vec<String>,
    /// Bytes of the decoded text already handed out.
    sent: usize,
    /// Set once a stop string appeared: the text ends before it.
    stopped_at: Option<usize>,
}

impl TextStream {
    pub fn new(stops: &[String]) -> Self {
        TextStream {
            ids: Vec::new(),
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            sent: 0,
            stopped_at: None,
        }
    }

    /// Whether a stop string has appeared.
    pub fn stopped(&self) -> bool {
        self.stopped_at.is_some()
    }

    /// Add `token`; return the text that can be handed out now (possibly empty).
    pub fn push(
        &mut self,
        token: u32,
        decode: &dyn Fn(&[u32]) -> Result<String>,
    ) -> Result<String> {
        if self.stopped() {
            return Ok(String::new());
        }
        self.ids.push(token);
        let text = decode(&self.ids)?;
        // A character still waiting for its last byte decodes as U+FFFD: hold it.
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let from = self.sent.min(text.len());
        // A stop string may begin before what is new: search from the longest one's reach.
        let reach = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut search = from.saturating_sub(reach);
        while !text.is_char_boundary(search) {
            search -= 1;
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| text[search..].find(s.as_str()).map(|i| search + i))
            .min()
        {
            self.stopped_at = Some(at);
            let out = text.get(from..at.max(from)).unwrap_or_default().to_string();
            self.sent = at.max(from);
            return Ok(out);
        }
        // Hold back a tail that is the beginning of a stop string.
        let mut end = text.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if text.len() >= k && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    end = end.min(text.len() - k);
                    break;
                }
            }
        }
        let end = end.max(from);
        let out = text[from..end].to_string();
        self.sent = end;
        Ok(out)
    }

    /// What is still held back once generation has ended without a stop string.
    pub fn finish(&mut self, decode: &dyn Fn(&[u32]) -> Result<String>) -> Result<String> {
        if self.stopped() || self.ids.is_empty() {
            return Ok(String::new());
        }
        let text = decode(&self.ids)?;
        let out = text
            .get(self.sent.min(text.len())..)
            .unwrap_or_default()
            .to_string();
        self.sent = text.len();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token `i` is the `i`-th piece (bytes, so characters can be split).
    fn decoder(pieces: &'static [&'static [u8]]) -> impl Fn(&[u32]) -> Result<String> {
        move |ids: &[u32]| {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| pieces[i as usize].iter().copied())
                .collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }

    fn run(pieces: &'static [&'static [u8]], stops: &[&str]) -> (Vec<String>, bool) {
        let d = decoder(pieces);
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::new(&stops);
        let mut out: Vec<String> = (0..pieces.len() as u32)
            .map(|t| s.push(t, &d).unwrap())
            .collect();
        out.push(s.finish(&d).unwrap());
        (out, s.stopped())
    }

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        // "é" is C3 A9, split over two tokens.
        let (out, stopped) = run(&[b"caf", b"\xC3", b"\xA9", b"!"], &[]);
        assert_eq!(out, ["caf", "", "é", "!", ""]);
        assert!(!stopped);
    }

    #[test]
    fn stop_strings_end_the_text_before_them_even_across_tokens() {
        let (out, stopped) = run(&[b"Hello", b" EN", b"D now"], &["END"]);
        assert_eq!(out.concat(), "Hello ");
        assert!(stopped);
        // "EN" (a stop string's start) was held back, never handed out.
        assert_eq!(out[1], " ");
        // A false start is released once it cannot be a stop string.
        let (out, stopped) = run(&[b"a EN", b"x"], &["END"]);
        assert_eq!(out, ["a ", "ENx", ""]);
        assert!(!stopped);
        // Without a stop, the held tail comes out at the end.
        let (out, _) = run(&[b"a EN"], &["END"]);
        assert_eq!(out.concat(), "a EN");
    }
}
