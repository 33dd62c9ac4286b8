//! API keys: `--api-key`, `--api-key-file`, or `ROCKET_API_KEY`. With any key
//! configured, `/v1/*` needs `Authorization: Bearer KEY`.
//!
//! Keys are kept as SHA-256 digests and a presented key is compared with every
//! one of them in constant time (`subtle`): neither the comparison nor the key's
//! length tells an attacker how close a guess came.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{bail, Context};
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The keys a request may present; empty means the server is open.
#[derive(Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} key(s))", self.digests.len())
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// A key must be a visible ASCII word: what an HTTP header carries unchanged.
fn check_key(key: &str, source: &dyn Fn() -> String) -> anyhow::Result<()> {
    if key.is_empty() {
        bail!("{}: an API key must not be empty", source());
    }
    if let Some(c) = key.chars().find(|c| !c.is_ascii_graphic()) {
        bail!("{}: an API key may hold only visible ASCII characters, not {c:?}", source());
    }
    Ok(())
}

impl ApiKeys {
    /// The keys from the flags (`--api-key` values, then the `--api-key-file`
    /// path and its text); `ROCKET_API_KEY` (`env`) only when no flag gave one.
    pub fn resolve(flags: &[String], file: Option<(&Path, &str)>, env: Option<&str>) -> anyhow::Result<Self> {
        let mut keys: Vec<String> = Vec::new();
        for key in flags {
            check_key(key, &|| "--api-key".to_string())?;
            keys.push(key.clone());
        }
        if let Some((path, text)) = file {
            let before = keys.len();
            for (n, line) in text.lines().enumerate() {
                let key = line.trim();
                if key.is_empty() || key.starts_with('#') {
                    continue;
                }
                check_key(key, &|| format!("--api-key-file {} line {}", path.display(), n + 1))?;
                keys.push(key.to_string());
            }
            if keys.len() == before {
                bail!("--api-key-file {}: the file holds no key (one per line; blank lines and # comments are skipped)", path.display());
            }
        }
        if keys.is_empty() {
            if let Some(key) = env {
                check_key(key, &|| "ROCKET_API_KEY".to_string())?;
                keys.push(key.to_string());
            }
        }
        Ok(ApiKeys { digests: keys.iter().map(|k| digest(k.as_bytes())).collect() })
    }

    /// `resolve` with the file read from disk.
    pub fn load(flags: &[String], file: Option<&Path>, env: Option<&str>) -> anyhow::Result<Self> {
        let text = match file {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("--api-key-file {}: cannot read it", path.display()))?),
            None => None,
        };
        Self::resolve(flags, file.zip(text.as_deref()), env)
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether `key` is one of the keys: every key is compared, in constant time.
    pub fn contains(&self, key: &[u8]) -> bool {
        let presented = digest(key);
        let mut found = subtle::Choice::from(0);
        for d in &self.digests {
            found |= d.ct_eq(&presented);
        }
        found.into()
    }

    /// Whether a request with `headers` may use the API: no keys configured, or
    /// `Authorization: Bearer KEY` with one of them (the scheme in any case).
    pub fn allows(&self, headers: &HeaderMap) -> Result<(), AuthFailure> {
        if self.is_empty() {
            return Ok(());
        }
        let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
            return Err(AuthFailure::Missing);
        };
        let bytes = value.as_bytes();
        match bytes.iter().position(|&b| b == b' ') {
            Some(i) if bytes[..i].eq_ignore_ascii_case(b"bearer") && self.contains(&bytes[i + 1..]) => Ok(()),
            Some(i) if bytes[..i].eq_ignore_ascii_case(b"bearer") => Err(AuthFailure::Wrong),
            _ => Err(AuthFailure::NotBearer),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    NotBearer,
    Wrong,
}

impl AuthFailure {
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "no API key given: send the header 'Authorization: Bearer YOUR_KEY'",
            AuthFailure::NotBearer => "the Authorization header must be 'Bearer YOUR_KEY'",
            AuthFailure::Wrong => "incorrect API key provided",
        }
    }
}

/// Whether `path` is behind the keys: the OpenAI API (`/v1` and below).
/// `/health` and `/metrics` stay open, as vLLM's do.
pub fn protects(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

/// The warning printed when the server listens beyond loopback with no key.
pub fn exposure_warning(addr: SocketAddr, keys: &ApiKeys) -> Option<String> {
    (keys.is_empty() && !addr.ip().is_loopback()).then(|| {
        format!(
            "rocket serve: warning: listening on {addr} with no API key: anyone who can reach this address can use the server \
             (set --api-key, --api-key-file or ROCKET_API_KEY)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(auth: Option<&[u8]>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(axum::http::header::AUTHORIZATION, HeaderValue::from_bytes(a).unwrap());
        }
        h
    }

    #[test]
    fn bearer_keys_are_checked_whole() {
        let keys = ApiKeys::resolve(&["sk-one".into(), "sk-two".into()], None, None).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.allows(&headers(Some(b"Bearer sk-one"))), Ok(()));
        assert_eq!(keys.allows(&headers(Some(b"bearer sk-two"))), Ok(()));
        for wrong in [&b"Bearer sk-on"[..], b"Bearer sk-one2", b"Bearer sk-onE", b"Bearer ", b"Bearer  sk-one", b"Bearer sk-one "] {
            assert_eq!(keys.allows(&headers(Some(wrong))), Err(AuthFailure::Wrong), "{}", String::from_utf8_lossy(wrong));
        }
        assert_eq!(keys.allows(&headers(Some(b"Basic sk-one"))), Err(AuthFailure::NotBearer));
        assert_eq!(keys.allows(&headers(Some(b"sk-one"))), Err(AuthFailure::NotBearer));
        assert_eq!(keys.allows(&headers(None)), Err(AuthFailure::Missing));
        // No key: everything passes.
        assert_eq!(ApiKeys::default().allows(&headers(None)), Ok(()));
    }

    #[test]
    fn keys_come_from_flags_and_file_else_the_variable() {
        let path = Path::new("keys.txt");
        let text = "# ops keys\n\n  sk-file-1  \nsk-file-2\n";
        let keys = ApiKeys::resolve(&["sk-flag".into()], Some((path, text)), Some("sk-env")).unwrap();
        assert_eq!(keys.len(), 3);
        assert!(keys.contains(b"sk-flag") && keys.contains(b"sk-file-1") && keys.contains(b"sk-file-2"));
        assert!(!keys.contains(b"sk-env") && !keys.contains(b"# ops keys"), "a flag wins over ROCKET_API_KEY");
        let keys = ApiKeys::resolve(&[], None, Some("sk-env")).unwrap();
        assert!(keys.len() == 1 && keys.contains(b"sk-env"));
        assert!(ApiKeys::resolve(&[], None, None).unwrap().is_empty());
    }

    #[test]
    fn bad_keys_are_errors_naming_their_source() {
        let cases: [(&[String], Option<(&Path, &str)>, Option<&str>, &str); 5] = [
            (&[String::new()], None, None, "--api-key: an API key must not be empty"),
            (&["a b".into()], None, None, "--api-key: an API key may hold only visible ASCII"),
            (&[], Some((Path::new("k.txt"), "# none\n\n")), None, "--api-key-file k.txt: the file holds no key"),
            (&[], Some((Path::new("k.txt"), "ok\nsk é\n")), None, "--api-key-file k.txt line 2"),
            (&[], None, Some(""), "ROCKET_API_KEY: an API key must not be empty"),
        ];
        for (flags, file, env, want) in cases {
            let e = ApiKeys::resolve(flags, file, env).unwrap_err().to_string();
            assert!(e.starts_with(want), "{e}");
        }
        let e = ApiKeys::load(&[], Some(Path::new("/nonexistent/keys")), None).unwrap_err();
        assert!(format!("{e:#}").contains("--api-key-file /nonexistent/keys: cannot read it"), "{e:#}");
    }

    #[test]
    fn only_the_api_is_protected_and_only_loopback_is_quiet() {
        assert!(protects("/v1/completions") && protects("/v1") && protects("/v1/models/x"));
        assert!(!protects("/health") && !protects("/metrics") && !protects("/v10") && !protects("/"));
        let open = ApiKeys::default();
        let keyed = ApiKeys::resolve(&["k".into()], None, None).unwrap();
        assert!(exposure_warning("127.0.0.1:8000".parse().unwrap(), &open).is_none());
        assert!(exposure_warning("[::1]:8000".parse().unwrap(), &open).is_none());
        assert!(exposure_warning("0.0.0.0:8000".parse().unwrap(), &keyed).is_none());
        let w = exposure_warning("0.0.0.0:8000".parse().unwrap(), &open).unwrap();
        assert!(w.contains("0.0.0.0:8000") && w.contains("no API key"), "{w}");
        assert!(exposure_warning("192.0.2.7:80".parse().unwrap(), &open).is_some());
    }
}
