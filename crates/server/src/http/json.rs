//! Parsing a request body as JSON, with every rejection an OpenAI-shaped [`ApiError`] that
//! names the field at fault (axum's own extractor answers malformed bodies in plain text). The
//! body itself is read by [`super::upload::receive`].

use serde::de::DeserializeOwned;
use serde_json::error::Category;

use super::error::ApiError;

/// Parse JSON, naming the field at fault for valid JSON of the wrong shape.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => {
                    Err(ApiError::InvalidJson(inner.to_string()))
                }
                Category::Data if path == "." => Err(ApiError::invalid(inner.to_string())),
                Category::Data => Err(ApiError::invalid_param(
                    path.clone(),
                    format!("{path}: {inner}"),
                )),
            }
        }
    }
}
