//! The OpenAPI 3.1 document served at `/openapi.json`: written by hand, held to the code by the
//! tests below (routes, the error table and the requests' fields).

pub const DOCUMENT: &str = include_str!("openapi.json");

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::{Value, json};

    use super::DOCUMENT;
    use crate::http::error::ApiError;
    use crate::http::json::parse;
    use crate::http::types::{ChatRequest, EmbeddingRequest, ImageRequest};

    fn doc() -> Value {
        serde_json::from_str(DOCUMENT).unwrap()
    }

    #[test]
    fn routes_match_the_router() {
        let paths: BTreeSet<String> = doc()["paths"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let want: BTreeSet<String> = [
            "/v1/embeddings",
            "/v1/chat/completions",
            "/v1/images/generations",
            "/v1/images/edits",
            "/v1/models",
            "/v1/models/{model}",
            "/health",
            "/metrics",
            "/openapi.json",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(paths, want);
        let router_src = include_str!("http/mod.rs");
        for p in &want {
            // A parameter that may hold `/` is a wildcard (`{*model}`) in the router.
            let wildcard = p.replace('{', "{*");
            assert!(
                router_src.contains(&format!(".route(\"{p}\""))
                    || router_src.contains(&format!(".route(\"{wildcard}\"")),
                "{p} not routed"
            );
        }
    }

    #[test]
    fn every_error_status_and_code_is_documented() {
        let doc = doc();
        // Every model route answers every error of the table (each refuses the others' models).
        let responses = doc["paths"]["/v1/embeddings"]["post"]["responses"]
            .as_object()
            .unwrap();
        let chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
            .as_object()
            .unwrap();
        let images = doc["paths"]["/v1/images/generations"]["post"]["responses"]
            .as_object()
            .unwrap();
        let edits = doc["paths"]["/v1/images/edits"]["post"]["responses"]
            .as_object()
            .unwrap();
        let keys = |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(responses), keys(chat));
        assert_eq!(keys(responses), keys(images));
        assert_eq!(keys(responses), keys(edits));
        let codes: BTreeSet<&str> = doc["components"]["schemas"]["Error"]["properties"]["error"]
            ["properties"]["code"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        let mut used = BTreeSet::new();
        let mut statuses = BTreeSet::new();
        for e in ApiError::examples() {
            let status = e.status().as_u16().to_string();
            assert!(
                responses.contains_key(&status),
                "status {status} of {e:?} is undocumented"
            );
            assert!(
                codes.contains(e.code()),
                "code {} is undocumented",
                e.code()
            );
            used.insert(e.code());
            statuses.insert(status);
        }
        assert_eq!(codes, used, "documented codes that nothing returns");
        let documented: BTreeSet<String> =
            responses.keys().filter(|k| *k != "200").cloned().collect();
        assert_eq!(
            documented, statuses,
            "documented statuses that nothing returns"
        );
    }

    #[test]
    fn request_fields_match_the_type() {
        let doc = doc();
        let props = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
            .as_object()
            .unwrap();
        let sample = |field: &str| match field {
            "input" => json!("x"),
            "dimensions" => json!(8),
            "encoding_format" => json!("base64"),
            _ => json!("x"),
        };
        // Every documented field is accepted…
        let mut body = serde_json::Map::new();
        for field in props.keys() {
            body.insert(field.clone(), sample(field));
        }
        let bytes = serde_json::to_vec(&body).unwrap();
        parse::<EmbeddingRequest>(&bytes).unwrap();
        // …and an undocumented one is refused.
        body.insert("extra".into(), json!(1));
        let bytes = serde_json::to_vec(&body).unwrap();
        let e = parse::<EmbeddingRequest>(&bytes).unwrap_err().to_string();
        assert!(e.contains("unknown field `extra`"), "{e}");
        let expected_list = e.split("expected one of ").nth(1).unwrap().to_string();
        for field in props.keys() {
            assert!(
                expected_list.contains(&format!("`{field}`")),
                "{field} missing from the type"
            );
        }
        assert_eq!(
            expected_list.matches('`').count() / 2,
            props.len(),
            "{expected_list}"
        );
    }

    /// The fields a struct's `Deserialize` knows, as serde passes them to `deserialize_struct`.
    fn fields_of<'de, T: serde::Deserialize<'de>>() -> Vec<&'static str> {
        use serde::de::{Error, Visitor};
        use serde::forward_to_deserialize_any;
        struct Capture;
        impl<'de> serde::Deserializer<'de> for Capture {
            type Error = serde::de::value::Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
                Err(Error::custom("not a struct"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Self::Error> {
                Err(Error::custom(fields.join(",")))
            }
            forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
                identifier ignored_any
            }
        }
        let e = T::deserialize(Capture).err().unwrap().to_string();
        let fields: &'static str = Box::leak(e.into_boxed_str());
        fields.split(',').collect()
    }

    #[test]
    fn chat_request_fields_match_the_type() {
        let doc = doc();
        let documented: BTreeSet<&str> = doc["components"]["schemas"]["ChatRequest"]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let fields: BTreeSet<&str> = fields_of::<ChatRequest>().into_iter().collect();
        assert_eq!(documented, fields);
        // Unknown fields are ignored, as OpenAI ignores them.
        let body = json!({"messages": [], "user": "u", "metadata": {"a": 1}, "store": false});
        parse::<ChatRequest>(&serde_json::to_vec(&body).unwrap()).unwrap();
    }

    #[test]
    fn image_edit_fields_are_the_image_request_and_the_upload() {
        let doc = doc();
        let props = |name: &str| -> BTreeSet<String> {
            doc["components"]["schemas"][name]["properties"]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect()
        };
        let mut want: BTreeSet<String> = fields_of::<ImageRequest>()
            .into_iter()
            .map(String::from)
            .collect();
        // Read by the form parser itself (crate::http::edits).
        for f in ["image", "image[]", "output_resolution", "input_fidelity"] {
            want.insert(f.into());
        }
        assert_eq!(props("ImageEditRequest"), want);
        let edit_src = include_str!("http/edits.rs");
        for f in [
            "\"image\"",
            "\"image[]\"",
            "\"output_resolution\"",
            "\"input_fidelity\"",
        ] {
            assert!(edit_src.contains(f), "{f} is not read by the form parser");
        }
    }

    #[test]
    fn image_request_fields_match_the_type() {
        let doc = doc();
        let schema = &doc["components"]["schemas"]["ImageRequest"];
        let documented: BTreeSet<&str> = schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let fields: BTreeSet<&str> = fields_of::<ImageRequest>().into_iter().collect();
        assert_eq!(documented, fields);
        // Unknown fields are refused, as the document says.
        assert_eq!(schema["additionalProperties"], false);
        let e = parse::<ImageRequest>(br#"{"prompt": "x", "steps": 4}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `steps`"), "{e}");
    }
}
