//! `--api-key`: a bearer token checked on every route but `/health`.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
use super::upload::drain;

pub async fn require_api_key(
    State(app): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let Some(key) = app.config.api_key.as_deref() else {
        return Ok(next.run(req).await);
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    let refused = match given {
        None => {
            ApiError::Unauthorized("missing API key: send the header Authorization: Bearer <key>")
        }
        Some(g) if constant_time_eq(g.trim().as_bytes(), key.as_bytes()) => {
            return Ok(next.run(req).await);
        }
        Some(_) => ApiError::Unauthorized("wrong API key"),
    };
    drain(req, app.config.limits.max_request_bytes).await;
    Err(refused)
}

/// The token of `Bearer <token>`. The scheme is case-insensitive (RFC 9110 §11.1), so
/// `bearer KEY` is as valid as `Bearer KEY`.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Compare without an early exit, so the time taken does not reveal how much of a guess matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, constant_time_eq};

    #[test]
    fn the_scheme_is_case_insensitive() {
        for v in [
            "Bearer k1",
            "bearer k1",
            "BEARER k1",
            "BeArEr k1",
            " Bearer k1",
        ] {
            assert_eq!(bearer_token(v), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "k1", "Token k1"] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }

    #[test]
    fn compares_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(!constant_time_eq(b"secret", b""));
    }
}
