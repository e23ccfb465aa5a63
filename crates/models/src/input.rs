//! Multimodal inputs shared by the families: an input is an ordered list of parts, each a text or
//! an image, that a model turns into one output (an embedding; later a chat turn's content).

use crate::imageproc::Image;

/// One part of an [`Input`].
#[derive(Clone, Debug)]
pub enum Part {
    Text(String),
    Image(Image),
}

/// Texts and images that become one output, in the order given.
#[derive(Clone, Debug, Default)]
pub struct Input {
    pub parts: Vec<Part>,
}

impl Input {
    pub fn text(text: impl Into<String>) -> Self {
        Input {
            parts: vec![Part::Text(text.into())],
        }
    }
    pub fn image(image: Image) -> Self {
        Input {
            parts: vec![Part::Image(image)],
        }
    }
    pub fn images(&self) -> impl Iterator<Item = &Image> {
        self.parts.iter().filter_map(|p| match p {
            Part::Image(i) => Some(i),
            Part::Text(_) => None,
        })
    }
}
