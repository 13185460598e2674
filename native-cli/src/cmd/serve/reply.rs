//! The API server's replies: OpenAI error objects (with OpenAI's `code` where it names one)
//! and JSON bodies.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// An OpenAI error response (`code`: OpenAI's, where it names one: `invalid_api_key`,
/// `model_not_found`).
pub(super) fn error_with(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    msg: impl Into<String>,
) -> Response {
    let body = json!({"error": {"message": msg.into(), "type": kind, "param": null, "code": code}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// A 200 JSON response.
pub(super) fn ok_json(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// An OpenAI error response without a code.
pub(super) fn error(status: StatusCode, kind: &str, msg: impl Into<String>) -> Response {
    error_with(status, kind, None, msg)
}

/// A 400 for a request nibble cannot take.
pub(super) fn bad(msg: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", msg)
}

/// A 503 with `Retry-After: 1`: every running place and queue place is taken.
pub(super) fn unavailable() -> Response {
    let mut r = error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "every sequence slot and queue place is taken: retry later",
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}
