//! E2B's in-sandbox daemon (envd) over a session: commands, the filesystem RPCs, `/files`.
//!
//! - **Connect protocol, JSON codec** (what E2B's SDKs speak to envd): a unary call is a
//!   `POST /{service}/{method}` with a JSON body, answered with JSON, or with an HTTP error
//!   status and `{"code", "message"}` (Connect's codes); a server-streaming call
//!   (`process.Process/Start`) sends and receives *envelopes* (1 flag byte, a big-endian
//!   u32 length, the JSON), the last one flagged end-of-stream with `{}` or `{"error"}`.
//! - `process.Process`: every command is a background process of the sandbox's session
//!   (`crate::service::processes`; the same files as its cells): `Start`, `Connect`,
//!   `List`, `SendInput`, `StreamInput`, `CloseStdin`, `SendSignal`, and PTYs (`Start`
//!   with a `pty`, `Update`) ([`process`] says how).
//! - `filesystem.Filesystem`: `Stat`, `ListDir` (depth >= 1), `MakeDir`
//!   (`already_exists` when it does), `Remove`, `Move`, and watchers ([`filesystem`]).
//! - `GET /files?path=` reads a file; `POST /files` writes files from a multipart form
//!   (field `file`, the path as its filename or `?path=`) or an octet-stream body with
//!   `?path=`, answering `[{"name", "type": "file", "path", "metadata"}]`: as envd 0.6.2,
//!   the `X-Metadata-<key>` headers become the file's metadata (`user.e2b.<key>` extended
//!   attributes, replaced at each upload), which `Stat`, `ListDir` and watcher entries
//!   report. Signed URLs (the SDK's `download_url` / `upload_url`: `signature`,
//!   `signature_expiration`, `username` in the query, no header) name no sandbox: the
//!   sandbox whose token makes the signature is the one (`crate::compat::e2b::signed`); a
//!   signed upload writes only the signed path.
//!   gzip both ways: a read answers gzip to `Accept-Encoding: gzip`, an octet-stream upload
//!   may come with `Content-Encoding: gzip` (decoded up to the file size limit).
//! - `GET /health`: 204 while the sandbox runs, 502 once it does not.
//!
//! **Paths**: E2B's home `/home/user` is bud's work directory `/tmp` mounted a second time
//! in the guest, so code sees the same files under both names. The API accepts paths under
//! either, or relative to the home, and names them under `/home/user` in its answers; any
//! other absolute path is `invalid_argument` (bud's file operations stay in the work
//! directory).
//!
//! **Users** ([`EnvdUser`]): as envd, a request acts as the user its `Authorization: Basic
//! base64("USER:")` header names (`/files` also takes the URL's `username`, which a signed
//! URL signs), and as E2B's default user `user` (uid 1000) when it names none, which is what
//! the SDK sends unless a call's `user=` says otherwise. Commands and PTYs run as that user,
//! in `/home/user` unless given a `cwd`; files written and directories made belong to it.
//! Reads, listings and removals run as root whoever asks. The guest has the users `root`
//! and `user`; any other is `invalid_argument`.

//!
//! Modules: [`filesystem`] (the filesystem RPCs) and [`process`] (commands); this one has
//! what they share (paths, Connect errors) and the plain HTTP routes (`/health`, `/files`).

mod connect;
pub mod filesystem;
pub mod process;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Compat;
use super::e2b::{Sandbox, e2b_error, sandbox_of};
use super::jupyter::HOME;
use crate::core::sessions::Entry;
use crate::http::error::{ApiError, Error};
use crate::service::files;
use vmm::files::Owner;

pub use filesystem::filesystem;
pub use process::process;

/// The work directory's other name in the guest.
const WORKDIR: &str = "/tmp";
/// Entries one `ListDir` may return.
const MAX_ENTRIES: usize = 10_000;

/// Whom an envd request acts as (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvdUser {
    Root,
    /// E2B's default: the guest's `user` (uid 1000, home `/home/user`).
    User,
}

impl EnvdUser {
    /// The user named `name` (`""`: the default one).
    pub fn named(name: &str) -> Result<Self, Error> {
        match name {
            "" | "user" => Ok(EnvdUser::User),
            "root" => Ok(EnvdUser::Root),
            other => Err(Error::invalid(
                "user",
                format!("{other:?} is not a user of bud's sandboxes (they have root and user)"),
            )),
        }
    }

    /// The user of a request: its `Authorization: Basic` header's user name, else the
    /// default one.
    pub fn of(headers: &HeaderMap) -> Result<Self, Error> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Ok(EnvdUser::User);
        };
        let bad = || Error::invalid("Authorization", "expected Basic base64(\"USER:\")");
        let value = value.to_str().map_err(|_| bad())?.trim();
        let Some((scheme, encoded)) = value.split_once(' ') else {
            return Err(bad());
        };
        if !scheme.eq_ignore_ascii_case("basic") {
            return Err(bad());
        }
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| bad())?;
        let text = String::from_utf8(decoded).map_err(|_| bad())?;
        Self::named(text.split(':').next().unwrap_or_default())
    }

    /// The user of a `/files` request: the URL's `username` if it has one, else
    /// [`EnvdUser::of`] its headers.
    pub fn of_files(headers: &HeaderMap, q: &FileQuery) -> Result<Self, Error> {
        match q.username.as_deref() {
            Some(name) if !name.is_empty() => Self::named(name),
            _ => Self::of(headers),
        }
    }

    /// The guest user a process runs as.
    pub fn name(self) -> &'static str {
        match self {
            EnvdUser::Root => "root",
            EnvdUser::User => "user",
        }
    }

    /// Whom what it writes belongs to.
    pub fn owner(self) -> Owner {
        match self {
            EnvdUser::Root => Owner::Root,
            EnvdUser::User => Owner::User,
        }
    }
}

/// A guest path relative to the work directory, from an E2B path (module docs).
pub fn guest_path(p: &str) -> Result<String, Error> {
    let p = p.trim_end_matches('/');
    let rel = if p.is_empty() || p == HOME || p == WORKDIR {
        "."
    } else if let Some(r) = p
        .strip_prefix(&format!("{HOME}/"))
        .or_else(|| p.strip_prefix(&format!("{WORKDIR}/")))
    {
        r
    } else if p.starts_with('/') {
        return Err(Error::invalid(
            "path",
            format!("{p}: bud sandboxes keep files under {HOME} (the same directory as {WORKDIR})"),
        ));
    } else {
        p
    };
    if rel != "." {
        crate::service::files::check_relative("path", rel)?;
    }
    Ok(rel.to_owned())
}

/// The E2B path of a guest path relative to the work directory.
pub(crate) fn e2b_path(rel: &str) -> String {
    if rel == "." || rel.is_empty() {
        HOME.to_owned()
    } else {
        format!("{HOME}/{}", rel.trim_start_matches("./"))
    }
}

/// Connect's code for a native error.
pub(crate) fn connect_code(e: &ApiError) -> &'static str {
    match e.status().as_u16() {
        400 => "invalid_argument",
        401 => "unauthenticated",
        404 => "not_found",
        409 => "aborted",
        413 | 429 | 507 => "resource_exhausted",
        410 | 502 | 503 => "unavailable",
        501 => "unimplemented",
        _ => "internal",
    }
}

/// A unary Connect error: Connect's HTTP status for the code, `{"code", "message"}`.
pub(crate) fn connect_error(code: &str, message: String) -> Response {
    let status = match code {
        "invalid_argument" => StatusCode::BAD_REQUEST,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(json!({"code": code, "message": message}))).into_response()
}

pub(crate) fn from_api(e: impl Into<ApiError>) -> Response {
    let e = e.into();
    connect_error(connect_code(&e), e.to_string())
}

/// `GET /health`.
pub async fn health(State(c): State<Compat>, headers: HeaderMap) -> Response {
    match sandbox_of(&c, &headers) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e2b_error(e),
    }
}

/// `GET/POST /files`'s query: the path, and for a signed URL (E2B's `download_url` and
/// `upload_url`) its signature, expiry and user.
#[derive(Debug, Default, Deserialize)]
pub struct FileQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<u64>,
}

/// The sandbox of a `/files` request: by its signature when the URL is signed (it names no
/// sandbox: the signature does, made with the sandbox's token), else by header and token.
fn file_sandbox(
    c: &Compat,
    headers: &HeaderMap,
    q: &FileQuery,
    operation: &str,
) -> Result<(Arc<Sandbox>, Arc<Entry>), ApiError> {
    match &q.signature {
        None => sandbox_of(c, headers),
        Some(signature) => super::e2b::signed(
            c,
            &super::e2b::SignedRequest {
                path: q.path.as_deref().unwrap_or_default(),
                operation,
                user: q.username.as_deref().unwrap_or_default(),
                signature,
                expiration: q.signature_expiration,
            },
        ),
    }
}

/// `GET /files?path=`.
pub async fn read_file(
    State(c): State<Compat>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Response {
    let run = async {
        let (_, e) = file_sandbox(&c, &headers, &q, "read")?;
        EnvdUser::of_files(&headers, &q)?;
        let path = guest_path(q.path.as_deref().unwrap_or_default())?;
        Ok::<_, ApiError>(files::read(&c.app, &e.id, &path).await?)
    };
    let bytes = match run.await {
        Ok(bytes) => bytes,
        Err(e) => return e2b_error(e),
    };
    let octets = [(header::CONTENT_TYPE, "application/octet-stream")];
    if accepts_gzip(&headers) {
        let gz = [(header::CONTENT_ENCODING, "gzip")];
        return (octets, gz, Bytes::from(gzip(&bytes))).into_response();
    }
    (octets, Bytes::from(bytes)).into_response()
}

/// Whether the client takes a gzip body (`Accept-Encoding`, E2B's `files.read(gzip=True)`).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|c| {
            let mut parts = c.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let refused = parts.any(|p| p.trim().replace(' ', "") == "q=0");
            name.eq_ignore_ascii_case("gzip") && !refused
        })
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(bytes);
    enc.finish().unwrap_or_default()
}

/// `body` decoded as its `Content-Encoding` says (none, or gzip: E2B's
/// `files.write(gzip=True)`), at most `limit` bytes once decoded.
fn decoded(encoding: Option<&str>, body: Vec<u8>, limit: usize) -> Result<Vec<u8>, ApiError> {
    use std::io::Read;
    match encoding.map(str::trim) {
        None | Some("") | Some("identity") => Ok(body),
        Some(e) if e.eq_ignore_ascii_case("gzip") => {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&body[..])
                .take(limit as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|err| Error::invalid("body", format!("not valid gzip: {err}")))?;
            if out.len() > limit {
                return Err(Error::TooLarge {
                    field: "file".into(),
                    bytes: out.len(),
                    limit,
                }
                .into());
            }
            Ok(out)
        }
        Some(other) => Err(Error::invalid(
            "Content-Encoding",
            format!("bud takes gzip or no encoding, not {other:?}"),
        )
        .into()),
    }
}

/// `POST /files`.
pub async fn write_files(
    State(c): State<Compat>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    match write(&c, q, req).await {
        Ok(written) => Json(written).into_response(),
        Err(e) => e2b_error(e),
    }
}

async fn write(c: &Compat, q: FileQuery, req: Request) -> Result<Vec<Value>, ApiError> {
    let (_, e) = file_sandbox(c, req.headers(), &q, "write")?;
    let owner = EnvdUser::of_files(req.headers(), &q)?.owner();
    let metadata = upload_metadata(req.headers())?;
    // A signature covers one path: every part goes there, whatever its file name says.
    let signed_path = q.signature.as_ref().and(q.path.clone());
    let state = &c.app;
    let limit = state.config().sessions.max_file_bytes;
    let too_large = |bytes| {
        ApiError::Service(Error::TooLarge {
            field: "file".into(),
            bytes,
            limit,
        })
    };
    let multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let encoding = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if multipart && encoding.is_some() {
        return Err(Error::invalid(
            "Content-Encoding",
            "an encoded body goes with an octet-stream upload (as E2B's SDK sends it)",
        )
        .into());
    }
    if multipart {
        let mut form = Multipart::from_request(req, state)
            .await
            .map_err(|err| ApiError::invalid("body", err.body_text()))?;
        while let Some(mut field) = form
            .next_field()
            .await
            .map_err(|err| ApiError::invalid("body", err.body_text()))?
        {
            let name = signed_path
                .clone()
                .or_else(|| field.file_name().map(str::to_owned))
                .or_else(|| q.path.clone())
                .ok_or_else(|| ApiError::invalid("path", "a file part needs a path"))?;
            let mut data = Vec::new();
            while let Some(chunk) = field
                .chunk()
                .await
                .map_err(|err| ApiError::invalid("body", err.body_text()))?
            {
                data.extend_from_slice(&chunk);
                if data.len() > limit {
                    return Err(too_large(data.len()));
                }
            }
            files.push((name, data));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| ApiError::invalid("path", "path is required"))?;
        let timeout = state.config().limits.body_timeout();
        let data = crate::http::body::read_limited(req.into_body(), limit, timeout)
            .await
            .map_err(|err| match err {
                ApiError::BodyTooLarge { limit } => too_large(limit + 1),
                other => other,
            })?;
        files.push((path, decoded(encoding.as_deref(), data, limit)?));
    }
    let mut written = Vec::with_capacity(files.len());
    for (path, data) in files {
        let rel = guest_path(&path)?;
        files::write_with_metadata(state, &e.id, &rel, data, owner, metadata.clone()).await?;
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_owned();
        let mut info = json!({"name": name, "type": "file", "path": e2b_path(&rel)});
        if !metadata.is_empty() {
            info["metadata"] = json!(metadata);
        }
        written.push(info);
    }
    Ok(written)
}

/// Prefix of the upload headers that carry E2B file metadata (`X-Metadata-<key>: value`).
const METADATA_HEADER: &str = "x-metadata-";
/// The extended-attribute namespace of E2B's metadata keys in the guest.
const METADATA_XATTR: &str = "user.e2b.";
/// envd's bounds: a key fits in an xattr name after [`METADATA_XATTR`] (255 bytes), and all
/// of a file's metadata (each key with that prefix, plus its value) in 4 KiB.
const METADATA_KEY_MAX: usize = 255 - METADATA_XATTR.len();
const METADATA_TOTAL_MAX: usize = 4096;

/// The metadata an upload sets, as envd reads it: every `X-Metadata-<key>` header (the key
/// lowercased, the first value of a repeated header), keys and values printable ASCII,
/// within envd's bounds. No such header: `{}`, which clears the file's metadata.
fn upload_metadata(headers: &HeaderMap) -> Result<BTreeMap<String, String>, Error> {
    let printable = |s: &[u8]| s.iter().all(|b| (0x20..=0x7e).contains(b));
    let mut metadata = BTreeMap::new();
    let mut total = 0;
    for name in headers.keys() {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        if key.is_empty() || metadata.contains_key(key) {
            continue;
        }
        let value = headers.get(name).map(|v| v.as_bytes()).unwrap_or_default();
        if key.len() > METADATA_KEY_MAX || !printable(key.as_bytes()) {
            return Err(Error::invalid(
                "metadata",
                format!("a metadata key is printable ASCII of at most {METADATA_KEY_MAX} bytes"),
            ));
        }
        if !printable(value) {
            return Err(Error::invalid(
                "metadata",
                format!("the value of metadata key {key:?} is not printable ASCII"),
            ));
        }
        total += METADATA_XATTR.len() + key.len() + value.len();
        let value = String::from_utf8_lossy(value).into_owned();
        metadata.insert(key.to_owned(), value);
    }
    if total > METADATA_TOTAL_MAX {
        return Err(Error::invalid(
            "metadata",
            format!("a file's metadata is at most {METADATA_TOTAL_MAX} bytes ({total} given)"),
        ));
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_bodies_round_trip_and_a_bomb_stops_at_the_limit() {
        let data = b"hello, gzip ".repeat(1000);
        let packed = gzip(&data);
        let bomb = gzip(&vec![0u8; 1 << 20]);

        assert!(packed.len() < data.len() / 10);
        assert_eq!(
            decoded(Some("gzip"), packed.clone(), 1 << 20).unwrap(),
            data
        );
        assert_eq!(decoded(None, data.clone(), 1 << 20).unwrap(), data);
        assert!(decoded(Some("gzip"), bomb, 1000).is_err());
        assert!(decoded(Some("br"), packed, 1 << 20).is_err());
        assert!(decoded(Some("gzip"), b"not gzip".to_vec(), 100).is_err());
    }

    #[test]
    fn accept_encoding_is_read_with_its_weights() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT_ENCODING, v.parse().unwrap());
            accepts_gzip(&h)
        };

        assert!(with("gzip"));
        assert!(with("br, GZIP;q=0.5"));
        assert!(!with("gzip;q=0"));
        assert!(!with("identity"));
        assert!(!accepts_gzip(&HeaderMap::new()));
    }

    #[test]
    fn upload_metadata_is_read_as_envd_reads_it() {
        let with = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            upload_metadata(&h)
        };
        let got = with(&[
            ("X-Metadata-Author", "ada"),
            ("x-metadata-author", "second"),
            ("X-Metadata-", "ignored"),
            ("X-Other", "not metadata"),
        ])
        .unwrap();
        assert_eq!(got, BTreeMap::from([("author".into(), "ada".into())]));
        assert!(with(&[]).unwrap().is_empty());
        let long = format!("x-metadata-{}", "k".repeat(247));
        assert!(with(&[(&long, "v")]).is_err());
        let ok = format!("x-metadata-{}", "k".repeat(246));
        assert!(with(&[(&ok, "v")]).is_ok());
        assert!(with(&[("x-metadata-tab", "a\tb")]).is_err());
        let big = "v".repeat(3000);
        assert!(with(&[("x-metadata-a", &big), ("x-metadata-b", &big)]).is_err());
    }

    #[test]
    fn the_user_comes_from_basic_auth_or_the_url() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            EnvdUser::of(&h).ok()
        };
        // What E2B's SDK sends for user="root" and user="user": base64 of "root:", "user:".
        assert_eq!(with("Basic cm9vdDo="), Some(EnvdUser::Root));
        assert_eq!(with("basic dXNlcjo="), Some(EnvdUser::User));
        assert_eq!(EnvdUser::of(&HeaderMap::new()).ok(), Some(EnvdUser::User));
        assert_eq!(with("Basic bm9ib2R5Og=="), None); // nobody:
        assert_eq!(with("Basic !!"), None);
        assert_eq!(with("Bearer x"), None);
        let q = |u: &str| FileQuery {
            username: Some(u.into()),
            ..FileQuery::default()
        };
        let root = {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, "Basic cm9vdDo=".parse().unwrap());
            h
        };
        assert_eq!(
            EnvdUser::of_files(&root, &q("user")).ok(),
            Some(EnvdUser::User)
        );
        assert_eq!(
            EnvdUser::of_files(&root, &FileQuery::default()).ok(),
            Some(EnvdUser::Root)
        );
        assert_eq!(EnvdUser::User.owner(), Owner::User);
    }

    #[test]
    fn e2b_paths_map_into_the_work_directory() {
        assert_eq!(guest_path("/home/user/a.txt").unwrap(), "a.txt");
        assert_eq!(guest_path("/tmp/d/a.txt").unwrap(), "d/a.txt");
        assert_eq!(guest_path("/home/user").unwrap(), ".");
        assert_eq!(guest_path("/home/user/").unwrap(), ".");
        assert_eq!(guest_path("rel/x").unwrap(), "rel/x");
        assert!(guest_path("/etc/passwd").is_err());
        assert!(guest_path("/home/user/../../etc/passwd").is_err());
        assert_eq!(e2b_path("d/a.txt"), "/home/user/d/a.txt");
        assert_eq!(e2b_path("."), "/home/user");
    }
}
