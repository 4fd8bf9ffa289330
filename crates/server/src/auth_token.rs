//! Auth tokens: what Authenticate hands out and every later call carries in
//! its gRPC metadata (`token`, as etcd's clients send it).
//!
//! Two kinds, as etcd offers (`--auth-token`):
//!
//! - **simple** (the default): a random string with a TTL
//!   (`--auth-token-ttl`, 300 s) that every use renews. The member the
//!   client authenticated with checks the password and proposes the token
//!   through the log ([`AuthTokenCommand`], etcd's InternalAuthenticate);
//!   every member holds it once that applies, so the client may take it to
//!   any member. The tokens are node-local state beside the replicated
//!   state, not part of it: a member that installs a snapshot holds only
//!   the tokens applied since, and one that restarts takes back from its
//!   log those whose time has not run out; a client whose token a member
//!   does not hold gets `etcdserver: invalid auth token` and authenticates
//!   again, as etcd's clients do. Each token remembers the password hash it
//!   was issued under, and a password change, a deleted user or disabling
//!   auth ends it on every member.
//! - **jwt**: a signed JSON Web Token (`--auth-token
//!   jwt,pub-key=PATH,priv-key=PATH,sign-method=RS256,ttl=5m`), valid on
//!   every member that has the public key. It names the user and the auth
//!   revision it was issued at; once the auth state moved past that
//!   revision it gets `etcdserver: revision of auth store is old`, on which
//!   clients authenticate again (a password change, a deleted user or a
//!   revoked role so take effect at once).
//!
//! Tokens are never printed (not in log lines, not in `Debug`). A simple
//! token is written to the Raft log on disk, as etcd's WAL holds them: the
//! data directory is as private as the member's keys.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::auth::{AuthError, AuthStore, PasswordHash};
use crate::pb::ferrypb::AuthTokenCommand;

/// Most simple tokens one member holds; past it, the one closest to expiry
/// makes room (each costs a bcrypt check to make, so this is reached only
/// by many clients that never reuse their tokens).
pub const SIMPLE_TOKENS_MAX: usize = 65_536;
/// Default TTL of simple tokens (etcd's `--auth-token-ttl`).
pub const SIMPLE_TOKEN_TTL_DEFAULT: Duration = Duration::from_secs(300);
/// Default TTL of JWTs (etcd's).
pub const JWT_TTL_DEFAULT: Duration = Duration::from_secs(300);
/// Longest token accepted from a client, in bytes.
pub const TOKEN_BYTES_MAX: usize = 8192;

/// Which tokens the member hands out (`--auth-token`).
#[derive(Clone, PartialEq, Eq, Default)]
pub enum TokenConfig {
    /// Random member-local tokens.
    #[default]
    Simple,
    /// Signed JSON Web Tokens.
    Jwt(JwtConfig),
}

impl fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenConfig::Simple => f.write_str("Simple"),
            TokenConfig::Jwt(jwt) => f.debug_tuple("Jwt").field(jwt).finish(),
        }
    }
}

/// The JWT options etcd takes: `sign-method`, `pub-key`, `priv-key`, `ttl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtConfig {
    /// The signing algorithm: RS256/384/512, PS256/384/512, ES256/384,
    /// EdDSA (keys in PEM files), or HS256/384/512 (the key file's bytes
    /// are the secret).
    pub sign_method: String,
    /// The key that checks signatures (for HS*, the secret).
    pub pub_key: Option<PathBuf>,
    /// The key that signs; a member without it checks tokens but cannot
    /// issue them.
    pub priv_key: Option<PathBuf>,
    /// How long a token is valid.
    pub ttl: Duration,
}

/// Parses a Go-style duration as etcd's options take it: `300s`, `5m`,
/// `1h30m`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (use e.g. 300s, 5m, 1h)");
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(1),
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        let part = unit
            .checked_mul(u32::try_from(number).map_err(|_| bad())?)
            .ok_or_else(bad)?;
        total = total.checked_add(part).ok_or_else(bad)?;
    }
    Ok(total)
}

impl FromStr for TokenConfig {
    type Err = String;

    /// `simple`, or `jwt,pub-key=PATH,priv-key=PATH,sign-method=RS256,ttl=5m`.
    fn from_str(text: &str) -> Result<TokenConfig, String> {
        let mut parts = text.split(',');
        match parts.next().map(str::trim) {
            Some("simple") => {
                if parts.next().is_some() {
                    return Err("--auth-token simple takes no options".to_string());
                }
                Ok(TokenConfig::Simple)
            }
            Some("jwt") => {
                let mut jwt = JwtConfig {
                    sign_method: String::new(),
                    pub_key: None,
                    priv_key: None,
                    ttl: JWT_TTL_DEFAULT,
                };
                for option in parts {
                    let (name, value) = option.split_once('=').ok_or_else(|| {
                        format!("--auth-token jwt: option {option:?} is not NAME=VALUE")
                    })?;
                    match name.trim() {
                        "sign-method" => jwt.sign_method = value.trim().to_string(),
                        "pub-key" => jwt.pub_key = Some(PathBuf::from(value.trim())),
                        "priv-key" => jwt.priv_key = Some(PathBuf::from(value.trim())),
                        "ttl" => jwt.ttl = parse_duration(value)?,
                        other => {
                            return Err(format!(
                                "--auth-token jwt: unknown option {other:?} (known: pub-key, priv-key, sign-method, ttl)"
                            ))
                        }
                    }
                }
                if jwt.sign_method.is_empty() {
                    return Err("--auth-token jwt needs sign-method=... (e.g. RS256)".to_string());
                }
                Algorithm::from_str(&jwt.sign_method)
                    .map_err(|_| format!("--auth-token jwt: unknown sign-method {:?}", jwt.sign_method))?;
                if jwt.pub_key.is_none() && jwt.priv_key.is_none() {
                    return Err("--auth-token jwt needs pub-key=PATH (and priv-key=PATH to issue tokens)".to_string());
                }
                Ok(TokenConfig::Jwt(jwt))
            }
            _ => Err(format!(
                "--auth-token {text:?}: expected simple or jwt,pub-key=...,priv-key=...,sign-method=...,ttl=..."
            )),
        }
    }
}

/// One simple token's record on this member.
struct SimpleEntry {
    user: String,
    /// The hash the token was issued under: a changed password ends it.
    hash: Option<PasswordHash>,
    deadline: Instant,
    /// What each use renews the deadline by.
    ttl: Duration,
}

/// Longest TTL a simple token may carry (a value from the log is clamped
/// to it, so that no deadline arithmetic can overflow).
pub const SIMPLE_TOKEN_TTL_MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// A simple token handed out through the log: what every member inserts
/// into its [`SimpleTokenTable`] when the command applies.
#[derive(Clone, PartialEq, Eq)]
pub struct AssignedToken {
    /// The user it names.
    pub user: String,
    /// The token itself.
    pub token: String,
    /// The user's password hash at the auth revision it was issued at.
    pub hash: Option<PasswordHash>,
    /// When it runs out unless used, by the wall clock (Unix ms).
    pub expires_unix_ms: u64,
    /// What each use renews it by, in milliseconds.
    pub ttl_ms: u64,
}

impl fmt::Debug for AssignedToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token is a credential: it is never printed.
        f.debug_struct("AssignedToken")
            .field("user", &self.user)
            .field("expires_unix_ms", &self.expires_unix_ms)
            .finish_non_exhaustive()
    }
}

/// The simple tokens this member holds. Node-local, like the watchers: it
/// is filled by applying [`AuthTokenCommand`]s, so every member holds every
/// token, but it is not part of the replicated state (not in snapshots,
/// not in the hash).
#[derive(Default)]
pub struct SimpleTokenTable {
    tokens: Mutex<HashMap<String, SimpleEntry>>,
}

impl fmt::Debug for SimpleTokenTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimpleTokenTable({} tokens)", self.len())
    }
}

impl SimpleTokenTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, SimpleEntry>> {
        // Nothing in the map is left half-changed by a panic.
        self.tokens
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Holds `assigned` until its wall-clock expiry (nothing, if that has
    /// passed: a token replayed from the log after a restart). Past
    /// [`SIMPLE_TOKENS_MAX`], the token closest to expiry makes room.
    pub fn insert(&self, assigned: &AssignedToken) {
        let ttl = Duration::from_millis(assigned.ttl_ms).min(SIMPLE_TOKEN_TTL_MAX);
        let remaining =
            Duration::from_millis(assigned.expires_unix_ms.saturating_sub(unix_now_ms())).min(ttl);
        if remaining.is_zero() {
            return;
        }
        let now = Instant::now();
        let Some(deadline) = now.checked_add(remaining) else {
            return;
        };
        let mut tokens = self.lock();
        if tokens.len() >= SIMPLE_TOKENS_MAX {
            tokens.retain(|_, entry| entry.deadline > now);
        }
        if tokens.len() >= SIMPLE_TOKENS_MAX {
            let oldest = tokens
                .iter()
                .min_by_key(|(_, entry)| entry.deadline)
                .map(|(token, _)| token.clone());
            if let Some(oldest) = oldest {
                tokens.remove(&oldest);
            }
        }
        tokens.insert(
            assigned.token.clone(),
            SimpleEntry {
                user: assigned.user.clone(),
                hash: assigned.hash.clone(),
                deadline,
                ttl,
            },
        );
    }

    /// The user `token` names by the auth state `auth`, renewing its TTL;
    /// an unknown or expired token, or one whose user's password changed or
    /// who is gone, is `InvalidAuthToken`.
    pub fn resolve(&self, token: &str, auth: &AuthStore) -> Result<String, AuthError> {
        let now = Instant::now();
        let mut tokens = self.lock();
        let Some(entry) = tokens.get_mut(token) else {
            return Err(AuthError::InvalidAuthToken);
        };
        let current = auth.users().get(&entry.user).map(|u| u.password.as_ref());
        if entry.deadline <= now || current != Some(entry.hash.as_ref()) {
            tokens.remove(token);
            return Err(AuthError::InvalidAuthToken);
        }
        if let Some(deadline) = now.checked_add(entry.ttl) {
            entry.deadline = deadline;
        }
        Ok(entry.user.clone())
    }

    /// Forgets every token of `user` (its password changed or it is gone).
    pub fn forget_user(&self, user: &str) {
        self.lock().retain(|_, entry| entry.user != user);
    }

    /// Forgets every token (auth was disabled, as etcd does).
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Whether `token` is held (expired or not).
    pub fn contains(&self, token: &str) -> bool {
        self.lock().contains_key(token)
    }

    /// How many tokens are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The claims of ferry's (and etcd's) JWTs.
#[derive(Serialize, Deserialize)]
struct Claims {
    username: String,
    revision: u64,
    exp: u64,
}

struct JwtTokens {
    algorithm: Algorithm,
    encoding: Option<EncodingKey>,
    decoding: DecodingKey,
    ttl: Duration,
}

enum Provider {
    Simple { ttl: Duration, issued: AtomicU64 },
    Jwt(Box<JwtTokens>),
}

/// This member's token provider: makes tokens and checks them.
pub struct Tokens {
    provider: Provider,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.provider {
            Provider::Simple { .. } => f.write_str("Tokens(simple)"),
            Provider::Jwt(jwt) => write!(f, "Tokens(jwt, {:?})", jwt.algorithm),
        }
    }
}

/// What [`Tokens::issue`] made.
pub enum Issued {
    /// A JWT, valid at once on every member with the public key.
    Signed(String),
    /// A simple token, valid once this command, proposed through the log,
    /// has applied (on every member it has applied on).
    Replicate(AuthTokenCommand),
}

fn read_key(path: &PathBuf) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|error| format!("cannot read {}: {error}", path.display()))
}

fn keys(
    algorithm: Algorithm,
    jwt: &JwtConfig,
) -> Result<(Option<EncodingKey>, DecodingKey), String> {
    use jsonwebtoken::Algorithm as A;
    let bad = |error: jsonwebtoken::errors::Error| format!("--auth-token jwt: bad key: {error}");
    let private = jwt.priv_key.as_ref().map(read_key).transpose()?;
    let public = jwt.pub_key.as_ref().map(read_key).transpose()?;
    match algorithm {
        A::HS256 | A::HS384 | A::HS512 => {
            let secret = public
                .or(private)
                .ok_or("--auth-token jwt: HS* needs a key file holding the secret")?;
            Ok((
                Some(EncodingKey::from_secret(&secret)),
                DecodingKey::from_secret(&secret),
            ))
        }
        A::RS256 | A::RS384 | A::RS512 | A::PS256 | A::PS384 | A::PS512 => {
            let public = public.ok_or("--auth-token jwt: pub-key=PATH is needed")?;
            Ok((
                private
                    .map(|p| EncodingKey::from_rsa_pem(&p))
                    .transpose()
                    .map_err(bad)?,
                DecodingKey::from_rsa_pem(&public).map_err(bad)?,
            ))
        }
        A::ES256 | A::ES384 => {
            let public = public.ok_or("--auth-token jwt: pub-key=PATH is needed")?;
            Ok((
                private
                    .map(|p| EncodingKey::from_ec_pem(&p))
                    .transpose()
                    .map_err(bad)?,
                DecodingKey::from_ec_pem(&public).map_err(bad)?,
            ))
        }
        A::EdDSA => {
            let public = public.ok_or("--auth-token jwt: pub-key=PATH is needed")?;
            Ok((
                private
                    .map(|p| EncodingKey::from_ed_pem(&p))
                    .transpose()
                    .map_err(bad)?,
                DecodingKey::from_ed_pem(&public).map_err(bad)?,
            ))
        }
    }
}

fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// 16 random letters and digits from the OS generator.
fn random_text() -> Result<String, AuthError> {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut bytes = [0u8; 16];
    // Without randomness no token is safe to hand out; the caller answers
    // the client with a retryable error instead.
    getrandom::fill(&mut bytes).map_err(|_| AuthError::TooManyRequests)?;
    Ok(bytes
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect())
}

impl Tokens {
    /// Simple tokens with the given TTL.
    pub fn simple(ttl: Duration) -> Tokens {
        Tokens {
            provider: Provider::Simple {
                ttl: ttl.min(SIMPLE_TOKEN_TTL_MAX),
                issued: AtomicU64::new(0),
            },
        }
    }

    /// The provider `config` asks for; `simple_ttl` is `--auth-token-ttl`.
    /// Errors name the option or key file at fault.
    pub fn new(config: &TokenConfig, simple_ttl: Duration) -> Result<Tokens, String> {
        match config {
            TokenConfig::Simple => Ok(Tokens::simple(simple_ttl)),
            TokenConfig::Jwt(jwt) => {
                let algorithm = Algorithm::from_str(&jwt.sign_method).map_err(|_| {
                    format!(
                        "--auth-token jwt: unknown sign-method {:?}",
                        jwt.sign_method
                    )
                })?;
                let (encoding, decoding) = keys(algorithm, jwt)?;
                Ok(Tokens {
                    provider: Provider::Jwt(Box::new(JwtTokens {
                        algorithm,
                        encoding,
                        decoding,
                        ttl: jwt.ttl,
                    })),
                })
            }
        }
    }

    /// Whether this provider hands out simple tokens.
    pub fn is_simple(&self) -> bool {
        match self.provider {
            Provider::Simple { .. } => true,
            Provider::Jwt(_) => false,
        }
    }

    /// A new token for `user`, whose password was checked against the auth
    /// state at `auth_revision`.
    pub fn issue(&self, user: &str, auth_revision: u64) -> Result<Issued, AuthError> {
        match &self.provider {
            Provider::Simple { ttl, issued } => {
                let random = random_text()?;
                let serial = issued.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
                let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
                Ok(Issued::Replicate(AuthTokenCommand {
                    user: user.to_string(),
                    token: format!("{random}.{serial}"),
                    auth_revision,
                    expires_unix_ms: unix_now_ms().saturating_add(ttl_ms),
                    ttl_ms,
                }))
            }
            Provider::Jwt(jwt) => {
                let Some(encoding) = &jwt.encoding else {
                    // A verify-only member (no priv-key) cannot issue one.
                    return Err(AuthError::AuthFailed);
                };
                let claims = Claims {
                    username: user.to_string(),
                    revision: auth_revision,
                    exp: unix_now().saturating_add(jwt.ttl.as_secs().max(1)),
                };
                jsonwebtoken::encode(&Header::new(jwt.algorithm), &claims, encoding)
                    .map(Issued::Signed)
                    .map_err(|error| {
                        tracing::warn!(%error, "cannot sign a JWT");
                        AuthError::AuthFailed
                    })
            }
        }
    }

    /// The user a token names, by the auth state `auth` and the simple
    /// tokens this member holds: see [`SimpleTokenTable::resolve`]; a JWT
    /// older than the auth state is `AuthOldRevision`.
    pub fn resolve(
        &self,
        token: &str,
        auth: &AuthStore,
        simple: &SimpleTokenTable,
    ) -> Result<String, AuthError> {
        if token.len() > TOKEN_BYTES_MAX {
            return Err(AuthError::InvalidAuthToken);
        }
        match &self.provider {
            Provider::Simple { .. } => simple.resolve(token, auth),
            Provider::Jwt(jwt) => {
                let mut validation = Validation::new(jwt.algorithm);
                validation.leeway = 0;
                validation.validate_aud = false;
                let data = jsonwebtoken::decode::<Claims>(token, &jwt.decoding, &validation)
                    .map_err(|_| AuthError::InvalidAuthToken)?;
                let claims = data.claims;
                if !auth.users().contains_key(&claims.username) {
                    return Err(AuthError::InvalidAuthToken);
                }
                if claims.revision < auth.revision() {
                    return Err(AuthError::AuthOldRevision);
                }
                Ok(claims.username)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_as_etcd_writes_them() {
        assert_eq!(parse_duration("300s"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn token_options_parse_as_etcd_takes_them() {
        assert_eq!("simple".parse::<TokenConfig>(), Ok(TokenConfig::Simple));
        let jwt: TokenConfig = "jwt,pub-key=/k.pub,priv-key=/k,sign-method=RS256,ttl=5m"
            .parse()
            .unwrap();
        assert_eq!(
            jwt,
            TokenConfig::Jwt(JwtConfig {
                sign_method: "RS256".into(),
                pub_key: Some("/k.pub".into()),
                priv_key: Some("/k".into()),
                ttl: Duration::from_secs(300),
            })
        );
        assert!("jwt,pub-key=/k".parse::<TokenConfig>().is_err());
        assert!("jwt,sign-method=XX256,pub-key=/k"
            .parse::<TokenConfig>()
            .is_err());
        assert!("jwt,sign-method=RS256,colour=red,pub-key=/k"
            .parse::<TokenConfig>()
            .is_err());
        assert!("opaque".parse::<TokenConfig>().is_err());
    }
}
