//! Which S3 operation a request is, from its method, whether it names a bucket or an object,
//! its query (S3 names most operations there: `?uploads`, `?uploadId=`, `?delete`,
//! `?tagging`, …) and `x-amz-copy-source`; and so what it may change.

use http::HeaderMap;
use http::Method;
use http::header::HeaderName;

use crate::fence::keys::decode_once as decode;
use crate::refusal::Refusal;
use crate::request::classify::Pinned;

/// The header that names a copy's source object.
pub static COPY_SOURCE: HeaderName = HeaderName::from_static("x-amz-copy-source");

/// What an operation may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Nothing: a read (GetObject, HeadObject, ListObjects, ListParts, SelectObjectContent…).
    Read,
    /// The object it names: PutObject, CopyObject, DeleteObject, object tagging, ACL,
    /// retention, legal hold, RestoreObject.
    Object,
    /// The object it names, and the upload its answer names, which is bound to the object
    /// and the token: CreateMultipartUpload.
    Create,
    /// The object it names, as a part of the upload its `uploadId` names, which must be bound
    /// to that object and the token: UploadPart, UploadPartCopy.
    Part,
    /// The same as [`Effect::Part`], ending the upload: CompleteMultipartUpload,
    /// AbortMultipartUpload.
    End,
    /// The objects its body names: DeleteObjects.
    Listed,
    /// Any object in its bucket: bucket writes (CreateBucket, DeleteBucket, lifecycle,
    /// replication, versioning, policy…), a browser form upload (whose key is in the body), and
    /// every operation fencegate does not know.
    Bucket,
    /// Anything: a write that names no bucket.
    Everything,
}

/// The query's parameter names, decoded, that S3 reads as naming an operation; the others
/// (the signature of a presigned URL, `x-id`, `versionId`, a GET's `response-*` overrides,
/// list parameters) only qualify it.
fn subresources(query: Option<&str>) -> Result<Vec<String>, Refusal> {
    let mut names = Vec::new();
    for (name, _) in pairs(query) {
        let name = decode(name)?;
        let lower = name.to_ascii_lowercase();
        let qualifier = lower.starts_with("x-amz-")
            || lower.starts_with("response-")
            || matches!(lower.as_str(), "x-id" | "versionid");
        if !qualifier {
            names.push(name);
        }
    }
    Ok(names)
}

/// The query's parameters as sent, `name=value` (a bare `name` has an empty value).
pub(super) fn pairs(query: Option<&str>) -> impl Iterator<Item = (&str, &str)> {
    let pairs = query.unwrap_or_default().split('&').filter(|p| !p.is_empty());
    pairs.map(|pair| pair.split_once('=').unwrap_or((pair, "")))
}

/// What a request with `method` and `query` to an object (`object`) or a bucket may change.
pub fn effect(method: &Method, object: bool, query: Option<&str>, headers: &HeaderMap) -> Result<Effect, Refusal> {
    // S3 writes nothing on these, whatever the query says.
    if *method == Method::GET || *method == Method::HEAD || *method == Method::OPTIONS {
        return Ok(Effect::Read);
    }
    let names = subresources(query)?;
    let has = |name: &str| names.iter().any(|n| n == name);
    let only = |allowed: &[&str]| names.iter().all(|n| allowed.contains(&n.as_str()));
    if headers.get_all(&COPY_SOURCE).iter().count() > 1 {
        return Err(Refusal::InvalidHeader { name: COPY_SOURCE.to_string(), reason: "sent more than once".into() });
    }
    let effect = match (method.as_str(), object) {
        ("PUT", true) if names.is_empty() => Effect::Object,
        ("PUT", true) if has("partNumber") && has("uploadId") && only(&["partNumber", "uploadId"]) => Effect::Part,
        ("PUT", true)
            if names.len() == 1 && ["tagging", "acl", "retention", "legal-hold"].contains(&names[0].as_str()) =>
        {
            Effect::Object
        }
        ("POST", true) if has("uploads") && only(&["uploads"]) => Effect::Create,
        ("POST", true) if has("uploadId") && only(&["uploadId"]) => Effect::End,
        ("POST", true) if has("restore") && only(&["restore"]) => Effect::Object,
        // SelectObjectContent reads the object and writes nothing.
        ("POST", true) if has("select") && only(&["select", "select-type"]) => Effect::Read,
        ("DELETE", true) if names.is_empty() => Effect::Object,
        ("DELETE", true) if has("uploadId") && only(&["uploadId"]) => Effect::End,
        ("DELETE", true) if names.len() == 1 && names[0] == "tagging" => Effect::Object,
        ("POST", false) if names.len() == 1 && names[0] == "delete" => Effect::Listed,
        _ => Effect::Bucket,
    };
    Ok(effect)
}

/// How a write with `effect` to an object is pinned to the object's state (docs/pins.md), by
/// the operations whose preconditions S3 servers honour: PutObject (not CopyObject, whose
/// `x-amz-copy-source` makes it a copy) and CompleteMultipartUpload leave the object with the
/// entity tag their answer names; DeleteObject leaves it absent, pinned only where the server
/// honours its `If-Match` (`conditional_deletes`). A write or delete of one version
/// (`versionId`) may leave the object's current state as it was, and is not pinned.
pub fn pinned(
    method: &Method,
    effect: Effect,
    query: Option<&str>,
    headers: &HeaderMap,
    conditional_deletes: bool,
) -> Result<Option<Pinned>, Refusal> {
    let mut plain = true;
    for (name, _) in pairs(query) {
        let name = decode(name)?;
        plain &= !name.eq_ignore_ascii_case("versionid");
    }
    let unqualified = plain && subresources(query)?.is_empty();
    Ok(match (method.as_str(), effect) {
        ("PUT", Effect::Object) if unqualified && !headers.contains_key(&COPY_SOURCE) => Some(Pinned::Put),
        ("POST", Effect::End) => Some(Pinned::Put),
        ("DELETE", Effect::Object) if unqualified && conditional_deletes => Some(Pinned::Delete),
        _ => None,
    })
}

/// The upload id a request's query carries (`uploadId`, decoded once, `+` read as a space as
/// the servers read a query); refused if it carries more than one, which servers would not
/// read alike.
pub fn upload_id(query: Option<&str>) -> Result<Option<String>, Refusal> {
    let mut found = None;
    for (name, value) in pairs(query) {
        if decode(name)? != "uploadId" {
            continue;
        }
        if found.is_some() {
            return Err(Refusal::BadRequest("the query names uploadId more than once".into()));
        }
        found = Some(decode(&value.replace('+', " "))?);
    }
    Ok(found)
}

/// The `UploadId` of a CreateMultipartUpload's answer (`InitiateMultipartUploadResult`), read
/// with a real XML parser; `None` if the body holds none.
pub fn created_upload_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    #[serde(rename = "InitiateMultipartUploadResult")]
    struct Initiated {
        #[serde(rename = "UploadId")]
        upload_id: String,
    }
    let text = std::str::from_utf8(body).ok()?;
    quick_xml::de::from_str::<Initiated>(text).ok().map(|i| i.upload_id).filter(|id| !id.is_empty())
}

/// Whether the body of a `200` answer is S3's `<Error>`: a CompleteMultipartUpload that failed
/// after the server had sent its status (S3 then keeps the upload open, and the SDKs send the
/// completion again).
pub fn failed_late(body: &[u8]) -> bool {
    root(body).is_some_and(|name| name == b"Error")
}

/// The entity tag a CompleteMultipartUpload's answer names for the object, read with a real XML
/// parser: the `ETag` of the root element (AWS and s3s-fs name it
/// `CompleteMultipartUploadResult`, moto `CompleteMultipartUploadResponse`), unescaped (AWS
/// writes its quotes as `&quot;`). `None` unless it is one strong tag in quotes.
pub fn completed_tag(body: &[u8]) -> Option<Box<str>> {
    #[derive(serde::Deserialize)]
    struct Completed {
        #[serde(rename = "ETag")]
        etag: String,
    }
    let root = root(body)?;
    if !root.starts_with(b"CompleteMultipartUpload") {
        return None;
    }
    let text = std::str::from_utf8(body).ok()?;
    let tag = quick_xml::de::from_str::<Completed>(text).ok()?.etag;
    let tag = tag.trim();
    let inner = tag.strip_prefix('"')?.strip_suffix('"')?;
    (!inner.is_empty() && !inner.contains('"')).then(|| tag.into())
}

/// The local name of a document's root element; `None` for a body that is not XML.
fn root(body: &[u8]) -> Option<Vec<u8>> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_reader(body);
    loop {
        match reader.read_event() {
            Ok(Event::Start(e) | Event::Empty(e)) => return Some(e.local_name().as_ref().to_vec()),
            Ok(Event::Eof) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}
