//! Envoy's ext_proc messages, read into the `http` types classification reads, and the answers
//! fencegate gives in them.

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue as EnvoyHeader, HeaderValueOption, header_value_option};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{BodySendMode, HeaderSendMode};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::value::Kind;
use http::header::{CONTENT_LENGTH, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Method, Uri};

use http_body_util::{BodyExt, Full};

use crate::refusal::Refusal;

/// The filter name under which Envoy sends the attributes fencegate asks for.
const FILTER: &str = "envoy.filters.http.ext_proc";

/// The attribute that says whether an answer is the backend's: `via_upstream`, or what made
/// Envoy answer itself (`upstream_reset_before_response_started{…}`, a timeout, …).
pub(super) const CODE_DETAILS: &str = "response.code_details";

/// A request's head as Envoy sent it.
#[derive(Debug)]
pub(super) struct Head {
    /// The method, the target (absolute, as HTTP/2's is) and the header fields.
    pub(super) request: http::Request<()>,
    /// The body's length, where the head declares it (or has none).
    pub(super) declared_body: Option<u64>,
    /// Whether the request ends with its head: no body message follows.
    pub(super) ends: bool,
}

impl Head {
    /// Reads `headers`: the pseudo-headers into the method and an absolute URI (as HTTP/2's
    /// are), the rest into a header map.
    pub(super) fn read(headers: &HttpHeaders) -> Result<Head, Refusal> {
        let bad = |why: String| Refusal::BadRequest(why);
        let (mut method, mut path, mut authority, mut scheme) = (None, None, None, None);
        let mut map = HeaderMap::new();
        for h in headers.headers.iter().flat_map(|m| m.headers.iter()) {
            let value = value_of(h);
            match h.key.as_str() {
                ":method" => {
                    method = Some(Method::from_bytes(value).map_err(|_| bad("a method that is not a token".into()))?)
                }
                ":path" => path = Some(PathAndQuery::try_from(value).map_err(|e| bad(format!("the path: {e}")))?),
                ":authority" => {
                    authority = Some(Authority::try_from(value).map_err(|e| bad(format!("the authority: {e}")))?)
                }
                ":scheme" => scheme = Some(Scheme::try_from(value).map_err(|e| bad(format!("the scheme: {e}")))?),
                key if key.starts_with(':') => {}
                key => {
                    let name = HeaderName::from_bytes(key.as_bytes())
                        .map_err(|_| bad(format!("{key:?} is not a header name")))?;
                    let value = HeaderValue::from_bytes(value).map_err(|_| bad(format!("the value of {key}")))?;
                    map.append(name, value);
                }
            }
        }
        let method = method.ok_or_else(|| bad("Envoy sent no :method".into()))?;
        let path = path.ok_or_else(|| bad("Envoy sent no :path".into()))?;
        let mut uri = Uri::builder().path_and_query(path);
        if let Some(authority) = authority {
            uri = uri.scheme(scheme.unwrap_or(Scheme::HTTP)).authority(authority);
        }
        let uri = uri.build().map_err(|e| bad(format!("the request target: {e}")))?;
        let length = map.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
        let declared_body = if headers.end_of_stream { Some(0) } else { length };
        let mut request = http::Request::new(());
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = map;
        Ok(Head { request, declared_body, ends: headers.end_of_stream })
    }

    /// What classification reads of it.
    pub(super) fn classified(&self) -> crate::request::classify::Head<'_> {
        crate::request::classify::Head {
            method: self.request.method(),
            uri: self.request.uri(),
            headers: self.request.headers(),
            declared_body: self.declared_body,
        }
    }
}

/// A header's value: Envoy sends `raw_value`, and `value` only from older releases.
fn value_of(h: &EnvoyHeader) -> &[u8] {
    if h.raw_value.is_empty() { h.value.as_bytes() } else { &h.raw_value }
}

/// The status of a response's head, and the attribute saying whether the backend sent it.
pub(super) fn answer_of(headers: &HttpHeaders, request: &ProcessingRequest) -> (u16, Option<String>) {
    let status = headers
        .headers
        .iter()
        .flat_map(|m| m.headers.iter())
        .find(|h| h.key == ":status")
        .and_then(|h| std::str::from_utf8(value_of(h)).ok()?.parse().ok())
        .unwrap_or(0);
    let details = [&request.attributes, &headers.attributes]
        .into_iter()
        .filter_map(|attributes| attributes.get(FILTER)?.fields.get(CODE_DETAILS))
        .find_map(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    (status, details)
}

/// The strong entity tag a response's head names in its one `ETag` field, if it does.
pub(super) fn strong_tag(headers: &HttpHeaders) -> Option<std::sync::Arc<str>> {
    let fields = headers.headers.iter().flat_map(|m| m.headers.iter());
    crate::request::pinned::strong_tag_of(fields.filter(|h| h.key.eq_ignore_ascii_case("etag")).map(value_of))
}

/// Lets the request's head go on, with `set` set on it (the canonical target, a canonical
/// `Destination`) and `mode` asked for the rest of the exchange.
pub(super) fn continue_head(set: Vec<(String, Vec<u8>)>, mode: Option<ProcessingMode>) -> ProcessingResponse {
    let response = CommonResponse { header_mutation: setting(set), ..Default::default() };
    respond(Answer::RequestHeaders(HeadersResponse { response: Some(response) }), mode)
}

/// Lets the backend's answer head go on to the client, without any header that would have it
/// speak for fencegate, and with `mode` asked for the rest of the exchange.
pub(super) fn continue_answer(error_header: &str, mode: Option<ProcessingMode>) -> ProcessingResponse {
    let header_mutation = HeaderMutation { set_headers: Vec::new(), remove_headers: vec![error_header.to_owned()] };
    let response = CommonResponse { header_mutation: Some(header_mutation), ..Default::default() };
    respond(Answer::ResponseHeaders(HeadersResponse { response: Some(response) }), mode)
}

/// Lets a request's body, which Envoy holds whole with its head, go on, with `set` set on the
/// head.
pub(super) fn continue_body(set: Vec<(String, Vec<u8>)>) -> ProcessingResponse {
    let response = CommonResponse { header_mutation: setting(set), ..Default::default() };
    respond(Answer::RequestBody(BodyResponse { response: Some(response) }), None)
}

/// Lets whatever `request` carries go on unchanged.
pub(super) fn continue_any(request: &ProcessingRequest) -> Option<ProcessingResponse> {
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Asked;
    let common = || Some(CommonResponse::default());
    let answer = match request.request.as_ref()? {
        Asked::RequestHeaders(_) => Answer::RequestHeaders(HeadersResponse { response: common() }),
        Asked::ResponseHeaders(_) => Answer::ResponseHeaders(HeadersResponse { response: common() }),
        Asked::RequestBody(_) => Answer::RequestBody(BodyResponse { response: common() }),
        Asked::ResponseBody(_) => Answer::ResponseBody(BodyResponse { response: common() }),
        Asked::RequestTrailers(_) => Answer::RequestTrailers(TrailersResponse::default()),
        Asked::ResponseTrailers(_) => Answer::ResponseTrailers(TrailersResponse::default()),
    };
    Some(respond(answer, None))
}

/// The rest of an exchange that needs nothing more of fencegate: no body, no answer.
pub(super) fn nothing_more() -> ProcessingMode {
    mode(HeaderSendMode::Skip, BodySendMode::None, BodySendMode::None)
}

/// The rest of an unfenced request whose body is counted against a limit: each chunk, and no
/// answer.
pub(super) fn counted_body() -> ProcessingMode {
    mode(HeaderSendMode::Skip, BodySendMode::Streamed, BodySendMode::None)
}

/// The rest of a fenced write's exchange: each body chunk held until it is answered, then the
/// answer's head.
pub(super) fn write_mode() -> ProcessingMode {
    mode(HeaderSendMode::Send, BodySendMode::Streamed, BodySendMode::None)
}

/// The rest of an exchange whose request names its resources in its body: the body whole, in
/// one message, held until it is answered; then the answer's head.
pub(super) fn whole_body() -> ProcessingMode {
    mode(HeaderSendMode::Send, BodySendMode::Buffered, BodySendMode::None)
}

/// The rest of an exchange whose answer's body is read (a multipart upload's): that body whole,
/// held until it is answered.
pub(super) fn answer_body() -> ProcessingMode {
    mode(HeaderSendMode::Send, BodySendMode::Streamed, BodySendMode::Buffered)
}

fn mode(answer: HeaderSendMode, request_body: BodySendMode, answer_body: BodySendMode) -> ProcessingMode {
    ProcessingMode {
        request_header_mode: HeaderSendMode::Send as i32,
        response_header_mode: answer as i32,
        request_body_mode: request_body as i32,
        response_body_mode: answer_body as i32,
        request_trailer_mode: HeaderSendMode::Skip as i32,
        response_trailer_mode: HeaderSendMode::Skip as i32,
    }
}

/// fencegate's own answer in place of the backend's: `resp`, a refusal in the protocol's form.
pub(super) async fn immediate(resp: http::Response<Full<Bytes>>, details: &str) -> ProcessingResponse {
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let set_headers = parts
        .headers
        .iter()
        .map(|(name, value)| overwrite(name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    let immediate = ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(parts.status.as_u16()) }),
        headers: Some(HeaderMutation { set_headers, remove_headers: Vec::new() }),
        body: body.to_vec(),
        grpc_status: None,
        details: details.to_owned(),
    };
    respond(Answer::ImmediateResponse(immediate), None)
}

/// The mutation that sets each of `set` on a head, if there is any.
fn setting(set: Vec<(String, Vec<u8>)>) -> Option<HeaderMutation> {
    (!set.is_empty()).then(|| HeaderMutation {
        set_headers: set.into_iter().map(|(key, raw_value)| overwrite(key, raw_value)).collect(),
        remove_headers: Vec::new(),
    })
}

fn overwrite(key: String, raw_value: Vec<u8>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader { key, value: String::new(), raw_value }),
        append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn respond(answer: Answer, mode_override: Option<ProcessingMode>) -> ProcessingResponse {
    ProcessingResponse { response: Some(answer), mode_override, ..Default::default() }
}
