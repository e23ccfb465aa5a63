//! `POST /v1/images/edits`: OpenAI's image edit request, a `multipart/form-data` body of the
//! condition images (`image`, or `image[]` repeated, up to 10, in the order the prompt names
//! them) and text fields: `prompt`, `model`, `n`, `size`, `response_format`, `output_format`,
//! `output_compression`, `background`, `quality`, `input_fidelity`, `user`, `stream`,
//! `partial_images`, the generations route's extensions (`seed`, `num_inference_steps`,
//! `guidance_scale`, `negative_prompt`) and `output_resolution` (condition images are resized to
//! about its square; Qwen-Image-2.1's default 1024). Without `size` (or with `auto`) the image
//! takes the last condition image's aspect.
//!
//! The form is received whole (the request size limit and upload places apply as for JSON
//! bodies), parsed, and the request then goes the generations route's way
//! ([`super::images`]): the same checks, cost budget (width × height × steps × n), queue,
//! streamed progress and cancellation. The images are decoded while the request is checked, off
//! the async threads. `mask` is refused: the model edits the whole image from the prompt.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::response::Response;
use serde_json::{Map, Value};

use super::AppState;
use super::access::Access;
use super::error::ApiError;
use super::images::{Started, Upload, enqueue, respond};
use super::routes::admit_received;
use super::types::ImageRequest;
use super::upload::{drain, receive_form};
use crate::model::Route;

/// The most parts a form may have: ten images and every text field, with room to spare.
const MAX_PARTS: usize = 64;

/// `POST /v1/images/edits`.
pub async fn edits(State(app): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let limit = app.config.limits.image_timeout;
    respond(limit, start(app, req)).await
}

/// Receive and parse the form, admit it for its `model`, then check and queue it as a
/// generation with condition images.
async fn start(app: AppState, req: Request) -> Result<Started, ApiError> {
    let arrived = Instant::now();
    if app.stopping.load(Ordering::Relaxed) {
        drain(req, app.config.limits.max_request_bytes).await;
        return Err(ApiError::ShuttingDown);
    }
    let access = Access::of(&req);
    let (bytes, boundary) = receive_form(&app, req).await?;
    let form = Form::parse(bytes.clone(), boundary).await?;
    let model = form.text.get("model").cloned();
    let admitted = admit_received(&app, bytes, model.as_deref(), Route::Images, access)?;
    let (body, upload) = form.into_request()?;
    enqueue(app, arrived, admitted, body, Some(upload)).await
}

/// A parsed form: the image files in order and each text field once.
#[derive(Debug, Default)]
struct Form {
    images: Vec<Bytes>,
    text: BTreeMap<String, String>,
}

impl Form {
    async fn parse(bytes: Bytes, boundary: String) -> Result<Self, ApiError> {
        let bad = |e: multer::Error| ApiError::invalid(format!("the form is malformed: {e}"));
        let body = futures_util::stream::once(async move { Ok::<_, Infallible>(bytes) });
        let mut parts = multer::Multipart::new(body, boundary);
        let mut form = Form::default();
        let mut count = 0;
        while let Some(field) = parts.next_field().await.map_err(bad)? {
            count += 1;
            if count > MAX_PARTS {
                return Err(ApiError::invalid(format!(
                    "the form has more than {MAX_PARTS} parts"
                )));
            }
            let name = field
                .name()
                .ok_or_else(|| ApiError::invalid("a part of the form has no name"))?
                .to_string();
            if name == "mask" {
                return Err(ApiError::invalid_param(
                    "mask",
                    "mask is not supported: the model edits the whole image from the prompt",
                ));
            }
            let data = field.bytes().await.map_err(bad)?;
            if name == "image" || name == "image[]" {
                form.images.push(data);
                continue;
            }
            let text = String::from_utf8(data.to_vec()).map_err(|_| {
                ApiError::invalid_param(&name, format!("the form field {name} is not UTF-8 text"))
            })?;
            if form.text.insert(name.clone(), text).is_some() {
                return Err(ApiError::invalid_param(
                    &name,
                    format!("the form field {name} is given twice"),
                ));
            }
        }
        Ok(form)
    }

    /// The generations route's request of the text fields (typed as the JSON body's are), and
    /// the upload.
    fn into_request(mut self) -> Result<(ImageRequest, Upload), ApiError> {
        if let Some(f) = self.text.remove("input_fidelity")
            && !["high", "low"].contains(&f.as_str())
        {
            return Err(ApiError::invalid_param(
                "input_fidelity",
                format!("input_fidelity {f:?}: use high or low"),
            ));
        }
        let output_resolution = match self.text.remove("output_resolution") {
            None => None,
            Some(r) => Some(r.trim().parse::<usize>().map_err(|_| {
                ApiError::invalid_param(
                    "output_resolution",
                    format!("output_resolution {r:?} is not a whole number of pixels"),
                )
            })?),
        };
        let mut fields = Map::new();
        for (name, text) in self.text {
            let value = match name.as_str() {
                "n"
                | "output_compression"
                | "partial_images"
                | "num_inference_steps"
                | "seed"
                | "guidance_scale" => serde_json::from_str::<Value>(text.trim())
                    .ok()
                    .filter(Value::is_number)
                    .ok_or_else(|| {
                        ApiError::invalid_param(&name, format!("{name} {text:?} is not a number"))
                    })?,
                "stream" => match text.trim() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    other => {
                        return Err(ApiError::invalid_param(
                            "stream",
                            format!("stream {other:?}: use true or false"),
                        ));
                    }
                },
                _ => Value::String(text),
            };
            fields.insert(name, value);
        }
        let body: ImageRequest = serde_json::from_value(Value::Object(fields))
            .map_err(|e| ApiError::invalid(format!("the form's fields: {e}")))?;
        Ok((
            body,
            Upload {
                images: self.images,
                output_resolution,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(parts: &[(&str, Option<&str>, &[u8])]) -> (Bytes, String) {
        let b = "XyZ".to_string();
        let mut body = Vec::new();
        for (name, file, data) in parts {
            body.extend(
                format!("--{b}\r\nContent-Disposition: form-data; name=\"{name}\"").bytes(),
            );
            if let Some(f) = file {
                body.extend(format!("; filename=\"{f}\"\r\nContent-Type: image/png").bytes());
            }
            body.extend(b"\r\n\r\n");
            body.extend(*data);
            body.extend(b"\r\n");
        }
        body.extend(format!("--{b}--\r\n").bytes());
        (Bytes::from(body), b)
    }

    #[tokio::test]
    async fn text_fields_are_typed_as_the_json_body_and_images_kept_in_order() {
        let (bytes, b) = form(&[
            ("image[]", Some("a.png"), b"first"),
            ("prompt", None, "make it blue".as_bytes()),
            ("n", None, b"2"),
            ("stream", None, b"true"),
            ("image[]", Some("b.png"), b"second"),
            ("output_resolution", None, b"512"),
            ("seed", None, b"7"),
        ]);
        let f = Form::parse(bytes, b).await.unwrap();
        let (req, upload) = f.into_request().unwrap();
        assert_eq!(req.prompt, "make it blue");
        assert_eq!((req.n, req.stream), (Some(2), Some(true)));
        assert_eq!(req.seed, Some(serde_json::json!(7)));
        assert_eq!(upload.output_resolution, Some(512));
        assert_eq!(upload.images, [Bytes::from("first"), Bytes::from("second")]);
    }

    #[tokio::test]
    async fn bad_fields_are_named() {
        async fn bad(parts: &[(&str, Option<&str>, &[u8])]) -> String {
            let (bytes, b) = form(parts);
            match Form::parse(bytes, b).await {
                Err(e) => e.to_string(),
                Ok(f) => f.into_request().err().unwrap().to_string(),
            }
        }
        let e = bad(&[("prompt", None, b"x"), ("n", None, b"two")]).await;
        assert!(e.contains("n \"two\" is not a number"), "{e}");
        let e = bad(&[("prompt", None, b"x"), ("mask", Some("m.png"), b"m")]).await;
        assert!(e.contains("mask is not supported"), "{e}");
        let e = bad(&[("prompt", None, b"x"), ("prompt", None, b"y")]).await;
        assert!(e.contains("given twice"), "{e}");
        let e = bad(&[("prompt", None, b"x"), ("colour", None, b"red")]).await;
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = bad(&[("n", None, b"1")]).await;
        assert!(e.contains("missing field `prompt`"), "{e}");
    }
}
