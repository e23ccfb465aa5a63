//! `--api-key`: a bearer token checked on every route but `/health`.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
use super::routes::drain;

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
        .and_then(|v| v.strip_prefix("Bearer "));
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
    use super::constant_time_eq;

    #[test]
    fn compares_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(!constant_time_eq(b"secret", b""));
    }
}
