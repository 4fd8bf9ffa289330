//! Users, roles and key permissions: the replicated auth state, etcd's rules
//! for it, and the permission checks.
//!
//! The state ([`AuthStore`]) is part of the key-value state machine: every
//! change is a command in the Raft log, applied in order on every member,
//! and the whole of it is in every snapshot. Each change that takes effect
//! raises the auth revision by one (etcd's `authRevision`, shown by
//! AuthStatus), so that a command authorized at revision R can tell at
//! apply whether the state moved since (see `ferrypb.AuthStamp`).
//!
//! Passwords are never stored: the API hashes them with bcrypt before a
//! command is proposed, and the log and snapshots hold the hash only. The
//! hash is wrapped in [`PasswordHash`], whose `Debug` hides it, and the
//! generated messages that carry a password or a hash get a `Debug` here
//! that leaves it out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use thiserror::Error;

use crate::pb::authpb::{self, permission::Type as PermType, Permission, UserAddOptions};
use crate::pb::etcdserverpb::{
    AuthRoleGrantPermissionRequest, AuthRoleRevokePermissionRequest, AuthUserAddRequest,
    AuthUserChangePasswordRequest, AuthUserGrantRoleRequest, AuthUserRevokeRoleRequest,
    AuthenticateRequest,
};
use crate::pb::ferrypb::AuthSnapshot;

/// The name of the user and of the role that may do everything.
pub const ROOT: &str = "root";
/// Longest user or role name, in bytes. etcd has no limit; ferry keeps
/// every name a client can make the cluster store small.
pub const NAME_BYTES_MAX: usize = 256;
/// Longest password, in bytes: bcrypt reads only the first 72 bytes, so a
/// longer password would be checked only in part. ferry refuses it (as Go's
/// bcrypt does since 2024) instead of truncating it silently.
pub const PASSWORD_BYTES_MAX: usize = 72;
/// Most users the cluster holds.
pub const USERS_MAX: usize = 10_000;
/// Most roles the cluster holds.
pub const ROLES_MAX: usize = 10_000;
/// Most permissions one role holds.
pub const PERMISSIONS_PER_ROLE_MAX: usize = 1024;
/// Most roles one user holds.
pub const ROLES_PER_USER_MAX: usize = 256;
/// Longest key or range end of a permission, in bytes (etcd's default
/// request limit bounds keys the same way).
pub const PERMISSION_KEY_BYTES_MAX: usize = 64 * 1024;

/// Why an auth call or a permission check failed, with etcd's messages
/// (clients match on the text) and, in [`AuthError::code`], its gRPC codes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AuthError {
    /// Auth cannot be enabled without a root user.
    #[error("etcdserver: root user does not exist")]
    RootUserNotExist,
    /// Auth cannot be enabled while the root user lacks the root role.
    #[error("etcdserver: root user does not have root role")]
    RootRoleNotExist,
    /// UserAdd for a name that is taken.
    #[error("etcdserver: user name already exists")]
    UserAlreadyExist,
    /// No user name was given, or no user was authenticated.
    #[error("etcdserver: user name is empty")]
    UserEmpty,
    /// The named user does not exist.
    #[error("etcdserver: user name not found")]
    UserNotFound,
    /// RoleAdd for a name that is taken.
    #[error("etcdserver: role name already exists")]
    RoleAlreadyExist,
    /// The named role does not exist.
    #[error("etcdserver: role name not found")]
    RoleNotFound,
    /// No role name was given.
    #[error("etcdserver: role name is empty")]
    RoleEmpty,
    /// Authenticate with a wrong name or password.
    #[error("etcdserver: authentication failed, invalid user ID or password")]
    AuthFailed,
    /// RoleGrantPermission without a permission.
    #[error("etcdserver: permission not given")]
    PermissionNotGiven,
    /// The user may not do this.
    #[error("etcdserver: permission denied")]
    PermissionDenied,
    /// UserRevokeRole of a role the user does not have.
    #[error("etcdserver: role is not granted to the user")]
    RoleNotGranted,
    /// RoleRevokePermission of a permission the role does not have.
    #[error("etcdserver: permission is not granted to the role")]
    PermissionNotGranted,
    /// Authenticate while auth is disabled.
    #[error("etcdserver: authentication is not enabled")]
    AuthNotEnabled,
    /// The token is unknown, expired, or its user's password changed:
    /// clients authenticate again on this.
    #[error("etcdserver: invalid auth token")]
    InvalidAuthToken,
    /// A change that would lock everyone out (removing root while auth is
    /// on).
    #[error("etcdserver: invalid auth management")]
    InvalidAuthMgmt,
    /// A JWT issued before the auth state last changed: clients
    /// authenticate again on this.
    #[error("etcdserver: revision of auth store is old")]
    AuthOldRevision,
    /// Too many Authenticate calls wait for a bcrypt check on this member.
    #[error("etcdserver: too many requests")]
    TooManyRequests,
    /// A name, password or list beyond ferry's bounds.
    #[error("ferry: {what} (limit {max})")]
    Bound {
        /// What was too long or too many.
        what: &'static str,
        /// The limit.
        max: usize,
    },
}

impl AuthError {
    /// The gRPC code etcd answers this error with.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            AuthError::RootUserNotExist
            | AuthError::RootRoleNotExist
            | AuthError::UserAlreadyExist
            | AuthError::UserNotFound
            | AuthError::RoleAlreadyExist
            | AuthError::RoleNotFound
            | AuthError::RoleNotGranted
            | AuthError::PermissionNotGranted
            | AuthError::AuthNotEnabled => Code::FailedPrecondition,
            AuthError::UserEmpty
            | AuthError::RoleEmpty
            | AuthError::AuthFailed
            | AuthError::PermissionNotGiven
            | AuthError::InvalidAuthMgmt
            | AuthError::AuthOldRevision
            | AuthError::Bound { .. } => Code::InvalidArgument,
            AuthError::PermissionDenied => Code::PermissionDenied,
            AuthError::InvalidAuthToken => Code::Unauthenticated,
            AuthError::TooManyRequests => Code::ResourceExhausted,
        }
    }
}

/// A bcrypt hash of a password. Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct PasswordHash(String);

impl PasswordHash {
    /// Wraps a hash as bcrypt wrote it (`$2b$...`).
    pub fn new(hash: String) -> PasswordHash {
        PasswordHash(hash)
    }

    /// The hash, for bcrypt's verify.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PasswordHash(<redacted>)")
    }
}

/// A user as the replicated state holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct User {
    /// The password's hash; `None` for a user added with no password (it
    /// can only be authenticated by its certificate's common name).
    pub password: Option<PasswordHash>,
    /// The roles granted, in name order.
    pub roles: BTreeSet<String>,
}

/// What an operation does with the keys it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads them (Range, a compare, a watch, prev_kv).
    Read,
    /// Writes them (Put, DeleteRange, a lease revoke).
    Write,
}

fn allows(perm: &Permission, access: Access) -> bool {
    matches!(
        (PermType::try_from(perm.perm_type), access),
        (Ok(PermType::Readwrite), _)
            | (Ok(PermType::Read), Access::Read)
            | (Ok(PermType::Write), Access::Write)
    )
}

/// A half-open key interval `[start, end)`; `end: None` is unbounded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Interval {
    start: Vec<u8>,
    end: Option<Vec<u8>>,
}

impl Interval {
    /// etcd's (key, range_end): empty range_end is the key alone, "\0" is
    /// every key from `key` on. A range_end at or below the key names no
    /// key, and is checked as the key alone (never more permissive).
    fn of(key: &[u8], range_end: &[u8]) -> Interval {
        let single = || {
            let mut end = key.to_vec();
            end.push(0);
            Some(end)
        };
        let end = if range_end.is_empty() {
            single()
        } else if range_end == [0] {
            None
        } else if range_end <= key {
            single()
        } else {
            Some(range_end.to_vec())
        };
        Interval {
            start: key.to_vec(),
            end,
        }
    }
}

/// Whether the union of `granted` covers all of `wanted`.
fn covered(wanted: &Interval, mut granted: Vec<Interval>) -> bool {
    granted.sort_by(|a, b| a.start.cmp(&b.start));
    // Everything in [wanted.start, reach) is covered.
    let mut reach = wanted.start.clone();
    let done = |reach: &Vec<u8>| matches!(&wanted.end, Some(end) if reach >= end);
    for interval in granted {
        if done(&reach) {
            return true;
        }
        if interval.start > reach {
            break;
        }
        match interval.end {
            None => return true,
            Some(end) if end > reach => reach = end,
            Some(_) => {}
        }
    }
    done(&reach)
}

/// The replicated auth state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthStore {
    enabled: bool,
    revision: u64,
    users: BTreeMap<String, User>,
    /// Each role's permissions, in (key, range_end) order.
    roles: BTreeMap<String, Vec<Permission>>,
}

impl Default for AuthStore {
    fn default() -> Self {
        AuthStore::new()
    }
}

fn check_name(name: &str, empty: AuthError) -> Result<(), AuthError> {
    if name.is_empty() {
        return Err(empty);
    }
    if name.len() > NAME_BYTES_MAX {
        return Err(AuthError::Bound {
            what: "user and role names must be shorter",
            max: NAME_BYTES_MAX,
        });
    }
    Ok(())
}

fn check_hash(hash: &str) -> Result<PasswordHash, AuthError> {
    // A bcrypt hash is 60 bytes; anything else in the log is refused the
    // same way on every replica rather than stored.
    if hash.len() != 60 || !hash.starts_with("$2") {
        return Err(AuthError::Bound {
            what: "a password hash must be a 60-byte bcrypt hash",
            max: 60,
        });
    }
    Ok(PasswordHash::new(hash.to_string()))
}

impl AuthStore {
    /// Auth off, no users, no roles, revision 1 (etcd's first).
    pub fn new() -> AuthStore {
        AuthStore {
            enabled: false,
            revision: 1,
            users: BTreeMap::new(),
            roles: BTreeMap::new(),
        }
    }

    /// Whether permissions are enforced.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The auth revision: raised by one with every change.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Every user, by name.
    pub fn users(&self) -> &BTreeMap<String, User> {
        &self.users
    }

    /// Every role's permissions, by name.
    pub fn roles(&self) -> &BTreeMap<String, Vec<Permission>> {
        &self.roles
    }

    fn bump(&mut self) {
        self.revision = self.revision.saturating_add(1);
    }

    fn is_root(&self, user: &str) -> bool {
        self.users.get(user).is_some_and(|u| u.roles.contains(ROOT))
    }

    /// etcd's IsAdminPermitted: with auth on, only a user with the root
    /// role passes.
    pub fn check_admin(&self, user: &str) -> Result<(), AuthError> {
        if !self.enabled {
            return Ok(());
        }
        if user.is_empty() {
            return Err(AuthError::UserEmpty);
        }
        match self.users.get(user) {
            None => Err(AuthError::UserNotFound),
            Some(u) if u.roles.contains(ROOT) => Ok(()),
            Some(_) => Err(AuthError::PermissionDenied),
        }
    }

    /// With auth on, the caller must be a user that exists (calls that
    /// need no key permission, such as a lease grant).
    pub fn check_user(&self, user: &str) -> Result<(), AuthError> {
        if !self.enabled {
            return Ok(());
        }
        if user.is_empty() {
            return Err(AuthError::UserEmpty);
        }
        if !self.users.contains_key(user) {
            return Err(AuthError::PermissionDenied);
        }
        Ok(())
    }

    /// Whether `user` may read or write every key of etcd's `(key,
    /// range_end)`: the union of the matching permissions of its roles
    /// must cover the whole interval. The root role may do everything.
    pub fn check_range(
        &self,
        user: &str,
        key: &[u8],
        range_end: &[u8],
        access: Access,
    ) -> Result<(), AuthError> {
        self.check_user(user)?;
        if !self.enabled || self.is_root(user) {
            return Ok(());
        }
        let Some(record) = self.users.get(user) else {
            return Err(AuthError::PermissionDenied);
        };
        let granted: Vec<Interval> = record
            .roles
            .iter()
            .filter_map(|role| self.roles.get(role))
            .flatten()
            .filter(|perm| allows(perm, access))
            .map(|perm| Interval::of(&perm.key, &perm.range_end))
            .collect();
        if covered(&Interval::of(key, range_end), granted) {
            Ok(())
        } else {
            Err(AuthError::PermissionDenied)
        }
    }

    /// The user's password hash, if it exists and has one.
    pub fn password_hash(&self, user: &str) -> Option<&PasswordHash> {
        self.users.get(user).and_then(|u| u.password.as_ref())
    }

    /// Turns auth on: needs a root user with the root role (etcd's rule).
    pub fn enable(&mut self) -> Result<(), AuthError> {
        if self.enabled {
            return Ok(());
        }
        let Some(root) = self.users.get(ROOT) else {
            return Err(AuthError::RootUserNotExist);
        };
        if !root.roles.contains(ROOT) {
            return Err(AuthError::RootRoleNotExist);
        }
        self.enabled = true;
        self.bump();
        Ok(())
    }

    /// Turns auth off.
    pub fn disable(&mut self) {
        if self.enabled {
            self.enabled = false;
            self.bump();
        }
    }

    /// Adds a user; the request carries the hash (or `no_password`).
    pub fn user_add(&mut self, request: &AuthUserAddRequest) -> Result<(), AuthError> {
        check_name(&request.name, AuthError::UserEmpty)?;
        if self.users.contains_key(&request.name) {
            return Err(AuthError::UserAlreadyExist);
        }
        if self.users.len() >= USERS_MAX {
            return Err(AuthError::Bound {
                what: "too many users",
                max: USERS_MAX,
            });
        }
        let no_password = request.options.as_ref().is_some_and(|o| o.no_password);
        let password = if no_password {
            None
        } else {
            Some(check_hash(&request.hashed_password)?)
        };
        self.users.insert(
            request.name.clone(),
            User {
                password,
                roles: BTreeSet::new(),
            },
        );
        self.bump();
        Ok(())
    }

    /// Deletes a user; root cannot go while auth is on.
    pub fn user_delete(&mut self, name: &str) -> Result<(), AuthError> {
        check_name(name, AuthError::UserEmpty)?;
        if self.enabled && name == ROOT {
            return Err(AuthError::InvalidAuthMgmt);
        }
        if self.users.remove(name).is_none() {
            return Err(AuthError::UserNotFound);
        }
        self.bump();
        Ok(())
    }

    /// Replaces a user's password hash (tokens issued under the old one
    /// stop working, see `auth_token`).
    pub fn user_change_password(
        &mut self,
        request: &AuthUserChangePasswordRequest,
    ) -> Result<(), AuthError> {
        check_name(&request.name, AuthError::UserEmpty)?;
        let hash = check_hash(&request.hashed_password)?;
        let Some(user) = self.users.get_mut(&request.name) else {
            return Err(AuthError::UserNotFound);
        };
        user.password = Some(hash);
        self.bump();
        Ok(())
    }

    /// Grants a role; the root role may be granted before it was added
    /// (etcdctl's `auth enable` relies on it). Granting a role the user
    /// has is a no-op, as in etcd.
    pub fn user_grant_role(&mut self, request: &AuthUserGrantRoleRequest) -> Result<(), AuthError> {
        check_name(&request.user, AuthError::UserEmpty)?;
        check_name(&request.role, AuthError::RoleEmpty)?;
        if !self.users.contains_key(&request.user) {
            return Err(AuthError::UserNotFound);
        }
        if request.role != ROOT && !self.roles.contains_key(&request.role) {
            return Err(AuthError::RoleNotFound);
        }
        let Some(user) = self.users.get_mut(&request.user) else {
            return Err(AuthError::UserNotFound);
        };
        if user.roles.contains(&request.role) {
            return Ok(());
        }
        if user.roles.len() >= ROLES_PER_USER_MAX {
            return Err(AuthError::Bound {
                what: "too many roles for one user",
                max: ROLES_PER_USER_MAX,
            });
        }
        user.roles.insert(request.role.clone());
        self.bump();
        Ok(())
    }

    /// Revokes a role; root keeps the root role while auth is on.
    pub fn user_revoke_role(
        &mut self,
        request: &AuthUserRevokeRoleRequest,
    ) -> Result<(), AuthError> {
        check_name(&request.name, AuthError::UserEmpty)?;
        check_name(&request.role, AuthError::RoleEmpty)?;
        if self.enabled && request.name == ROOT && request.role == ROOT {
            return Err(AuthError::InvalidAuthMgmt);
        }
        let Some(user) = self.users.get_mut(&request.name) else {
            return Err(AuthError::UserNotFound);
        };
        if !user.roles.remove(&request.role) {
            return Err(AuthError::RoleNotGranted);
        }
        self.bump();
        Ok(())
    }

    /// Adds a role without permissions.
    pub fn role_add(&mut self, name: &str) -> Result<(), AuthError> {
        check_name(name, AuthError::RoleEmpty)?;
        if self.roles.contains_key(name) {
            return Err(AuthError::RoleAlreadyExist);
        }
        if self.roles.len() >= ROLES_MAX {
            return Err(AuthError::Bound {
                what: "too many roles",
                max: ROLES_MAX,
            });
        }
        self.roles.insert(name.to_string(), Vec::new());
        self.bump();
        Ok(())
    }

    /// Deletes a role and takes it from every user; the root role cannot
    /// go while auth is on.
    pub fn role_delete(&mut self, name: &str) -> Result<(), AuthError> {
        check_name(name, AuthError::RoleEmpty)?;
        if self.enabled && name == ROOT {
            return Err(AuthError::InvalidAuthMgmt);
        }
        if self.roles.remove(name).is_none() {
            return Err(AuthError::RoleNotFound);
        }
        for user in self.users.values_mut() {
            user.roles.remove(name);
        }
        self.bump();
        Ok(())
    }

    /// Grants a permission; one on the same (key, range_end) is replaced.
    pub fn role_grant_permission(
        &mut self,
        request: &AuthRoleGrantPermissionRequest,
    ) -> Result<(), AuthError> {
        check_name(&request.name, AuthError::RoleEmpty)?;
        let Some(perm) = &request.perm else {
            return Err(AuthError::PermissionNotGiven);
        };
        if PermType::try_from(perm.perm_type).is_err() {
            return Err(AuthError::PermissionNotGiven);
        }
        if perm.key.len() > PERMISSION_KEY_BYTES_MAX
            || perm.range_end.len() > PERMISSION_KEY_BYTES_MAX
        {
            return Err(AuthError::Bound {
                what: "a permission's key and range end must be shorter",
                max: PERMISSION_KEY_BYTES_MAX,
            });
        }
        let Some(perms) = self.roles.get_mut(&request.name) else {
            return Err(AuthError::RoleNotFound);
        };
        let position = perms.binary_search_by(|p| {
            (p.key.as_slice(), p.range_end.as_slice())
                .cmp(&(perm.key.as_slice(), perm.range_end.as_slice()))
        });
        match position {
            Ok(at) => perms[at].perm_type = perm.perm_type,
            Err(at) => {
                if perms.len() >= PERMISSIONS_PER_ROLE_MAX {
                    return Err(AuthError::Bound {
                        what: "too many permissions for one role",
                        max: PERMISSIONS_PER_ROLE_MAX,
                    });
                }
                perms.insert(
                    at,
                    Permission {
                        perm_type: perm.perm_type,
                        key: perm.key.clone(),
                        range_end: perm.range_end.clone(),
                    },
                );
            }
        }
        self.bump();
        Ok(())
    }

    /// Revokes the permission on exactly (key, range_end).
    pub fn role_revoke_permission(
        &mut self,
        request: &AuthRoleRevokePermissionRequest,
    ) -> Result<(), AuthError> {
        check_name(&request.role, AuthError::RoleEmpty)?;
        let Some(perms) = self.roles.get_mut(&request.role) else {
            return Err(AuthError::RoleNotFound);
        };
        let before = perms.len();
        perms.retain(|p| !(p.key == request.key && p.range_end == request.range_end));
        if perms.len() == before {
            return Err(AuthError::PermissionNotGranted);
        }
        self.bump();
        Ok(())
    }

    /// The state as a snapshot holds it: users and roles in name order.
    pub fn to_snapshot(&self) -> AuthSnapshot {
        AuthSnapshot {
            enabled: self.enabled,
            revision: self.revision,
            users: self
                .users
                .iter()
                .map(|(name, user)| authpb::User {
                    name: name.as_bytes().to_vec(),
                    password: user
                        .password
                        .as_ref()
                        .map(|h| h.as_str().as_bytes().to_vec())
                        .unwrap_or_default(),
                    roles: user.roles.iter().cloned().collect(),
                    options: Some(UserAddOptions {
                        no_password: user.password.is_none(),
                    }),
                })
                .collect(),
            roles: self
                .roles
                .iter()
                .map(|(name, perms)| authpb::Role {
                    name: name.as_bytes().to_vec(),
                    key_permission: perms.clone(),
                })
                .collect(),
        }
    }

    /// Rebuilds the state from a snapshot's part (`None`: a snapshot from
    /// before auth existed, which had none).
    pub fn from_snapshot(snapshot: Option<AuthSnapshot>) -> Result<AuthStore, String> {
        let Some(snapshot) = snapshot else {
            return Ok(AuthStore::new());
        };
        let text = |bytes: Vec<u8>| {
            String::from_utf8(bytes).map_err(|_| "an auth name is not UTF-8".to_string())
        };
        let mut users = BTreeMap::new();
        for user in snapshot.users {
            let name = text(user.name)?;
            let no_password = user.options.as_ref().is_some_and(|o| o.no_password);
            let password = if no_password {
                None
            } else {
                Some(PasswordHash::new(text(user.password)?))
            };
            let roles = user.roles.into_iter().collect();
            users.insert(name, User { password, roles });
        }
        let mut roles = BTreeMap::new();
        for role in snapshot.roles {
            let mut perms = role.key_permission;
            perms.sort_by(|a, b| (&a.key, &a.range_end).cmp(&(&b.key, &b.range_end)));
            roles.insert(text(role.name)?, perms);
        }
        Ok(AuthStore {
            enabled: snapshot.enabled,
            revision: snapshot.revision,
            users,
            roles,
        })
    }
}

// Debug for the generated messages that carry a password or a hash: every
// field but those.

impl fmt::Debug for AuthenticateRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthenticateRequest")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl fmt::Debug for AuthUserAddRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthUserAddRequest")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .field("options", &self.options)
            .field("hashed_password", &"<redacted>")
            .finish()
    }
}

impl fmt::Debug for AuthUserChangePasswordRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthUserChangePasswordRequest")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .field("hashed_password", &"<redacted>")
            .finish()
    }
}

impl fmt::Debug for authpb::User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("User")
            .field("name", &String::from_utf8_lossy(&self.name))
            .field("password", &"<redacted>")
            .field("roles", &self.roles)
            .field("options", &self.options)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(kind: PermType, key: &str, range_end: &str) -> Permission {
        Permission {
            perm_type: kind as i32,
            key: key.as_bytes().to_vec(),
            range_end: range_end.as_bytes().to_vec(),
        }
    }

    fn hash() -> String {
        // A syntactically valid bcrypt hash; its password does not matter.
        format!("$2b$04${}", "a".repeat(53))
    }

    fn store_with(perms: Vec<Permission>) -> AuthStore {
        let mut store = AuthStore::new();
        for name in [ROOT, "alice"] {
            store
                .user_add(&AuthUserAddRequest {
                    name: name.into(),
                    hashed_password: hash(),
                    ..Default::default()
                })
                .unwrap();
        }
        store
            .user_grant_role(&AuthUserGrantRoleRequest {
                user: ROOT.into(),
                role: ROOT.into(),
            })
            .unwrap();
        store.role_add("r").unwrap();
        for p in perms {
            store
                .role_grant_permission(&AuthRoleGrantPermissionRequest {
                    name: "r".into(),
                    perm: Some(p),
                })
                .unwrap();
        }
        store
            .user_grant_role(&AuthUserGrantRoleRequest {
                user: "alice".into(),
                role: "r".into(),
            })
            .unwrap();
        store.enable().unwrap();
        store
    }

    #[test]
    fn a_single_key_permission_covers_that_key_only() {
        let s = store_with(vec![perm(PermType::Read, "a", "")]);
        assert_eq!(s.check_range("alice", b"a", b"", Access::Read), Ok(()));
        assert_eq!(
            s.check_range("alice", b"a", b"", Access::Write),
            Err(AuthError::PermissionDenied)
        );
        assert_eq!(
            s.check_range("alice", b"ab", b"", Access::Read),
            Err(AuthError::PermissionDenied)
        );
        assert_eq!(
            s.check_range("alice", b"a", b"b", Access::Read),
            Err(AuthError::PermissionDenied)
        );
    }

    #[test]
    fn prefix_range_and_from_key_permissions() {
        // Prefix "p/" is [p/, p0); a range [c, f); from "x" on.
        let s = store_with(vec![
            perm(PermType::Readwrite, "p/", "p0"),
            perm(PermType::Write, "c", "f"),
            perm(PermType::Read, "x", "\0"),
        ]);
        assert_eq!(s.check_range("alice", b"p/1", b"", Access::Write), Ok(()));
        assert_eq!(s.check_range("alice", b"p/", b"p0", Access::Read), Ok(()));
        assert!(s.check_range("alice", b"p", b"p0", Access::Read).is_err());
        assert_eq!(s.check_range("alice", b"c", b"f", Access::Write), Ok(()));
        assert_eq!(s.check_range("alice", b"d", b"e", Access::Write), Ok(()));
        assert!(s.check_range("alice", b"d", b"g", Access::Write).is_err());
        assert!(s.check_range("alice", b"c", b"f", Access::Read).is_err());
        assert_eq!(s.check_range("alice", b"x", b"\0", Access::Read), Ok(()));
        assert_eq!(s.check_range("alice", b"zzz", b"", Access::Read), Ok(()));
        assert!(s.check_range("alice", b"w", b"\0", Access::Read).is_err());
        assert!(s.check_range("alice", b"x", b"\0", Access::Write).is_err());
    }

    #[test]
    fn adjacent_permissions_cover_their_union() {
        let s = store_with(vec![
            perm(PermType::Read, "a", "c"),
            perm(PermType::Readwrite, "c", "e"),
        ]);
        assert_eq!(s.check_range("alice", b"a", b"e", Access::Read), Ok(()));
        assert!(s.check_range("alice", b"a", b"f", Access::Read).is_err());
    }

    #[test]
    fn root_may_do_everything_and_others_need_a_user() {
        let s = store_with(vec![]);
        assert_eq!(s.check_range(ROOT, b"\0", b"\0", Access::Write), Ok(()));
        assert_eq!(s.check_admin(ROOT), Ok(()));
        assert_eq!(s.check_admin("alice"), Err(AuthError::PermissionDenied));
        assert_eq!(s.check_admin(""), Err(AuthError::UserEmpty));
        assert_eq!(s.check_admin("bob"), Err(AuthError::UserNotFound));
        assert_eq!(
            s.check_range("", b"a", b"", Access::Read),
            Err(AuthError::UserEmpty)
        );
        assert_eq!(
            s.check_range("bob", b"a", b"", Access::Read),
            Err(AuthError::PermissionDenied)
        );
    }

    #[test]
    fn etcd_rules_for_root_and_enable() {
        let mut s = AuthStore::new();
        assert_eq!(s.enable(), Err(AuthError::RootUserNotExist));
        s.user_add(&AuthUserAddRequest {
            name: ROOT.into(),
            hashed_password: hash(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.enable(), Err(AuthError::RootRoleNotExist));
        s.user_grant_role(&AuthUserGrantRoleRequest {
            user: ROOT.into(),
            role: ROOT.into(),
        })
        .unwrap();
        let before = s.revision();
        s.enable().unwrap();
        assert_eq!(s.revision(), before + 1);
        assert_eq!(s.user_delete(ROOT), Err(AuthError::InvalidAuthMgmt));
        assert_eq!(
            s.user_revoke_role(&AuthUserRevokeRoleRequest {
                name: ROOT.into(),
                role: ROOT.into()
            }),
            Err(AuthError::InvalidAuthMgmt)
        );
        s.role_add(ROOT).unwrap();
        assert_eq!(s.role_delete(ROOT), Err(AuthError::InvalidAuthMgmt));
        assert_eq!(s.role_add(ROOT), Err(AuthError::RoleAlreadyExist));
        assert_eq!(s.role_add(""), Err(AuthError::RoleEmpty));
        assert_eq!(
            s.user_add(&AuthUserAddRequest::default()),
            Err(AuthError::UserEmpty)
        );
        assert_eq!(
            s.user_add(&AuthUserAddRequest {
                name: ROOT.into(),
                hashed_password: hash(),
                ..Default::default()
            }),
            Err(AuthError::UserAlreadyExist)
        );
        assert!(matches!(
            s.user_add(&AuthUserAddRequest {
                name: "x".repeat(NAME_BYTES_MAX + 1),
                hashed_password: hash(),
                ..Default::default()
            }),
            Err(AuthError::Bound { .. })
        ));
        assert!(matches!(
            s.user_add(&AuthUserAddRequest {
                name: "plain".into(),
                hashed_password: "not a hash".into(),
                ..Default::default()
            }),
            Err(AuthError::Bound { .. })
        ));
        let revision = s.revision();
        s.disable();
        assert_eq!(s.revision(), revision + 1);
        s.user_delete(ROOT).unwrap();
    }

    #[test]
    fn grants_and_revokes_report_etcds_errors() {
        let mut s = store_with(vec![perm(PermType::Read, "a", "")]);
        assert_eq!(
            s.role_revoke_permission(&AuthRoleRevokePermissionRequest {
                role: "r".into(),
                key: b"b".to_vec(),
                range_end: vec![],
            }),
            Err(AuthError::PermissionNotGranted)
        );
        assert_eq!(
            s.role_grant_permission(&AuthRoleGrantPermissionRequest {
                name: "r".into(),
                perm: None
            }),
            Err(AuthError::PermissionNotGiven)
        );
        assert_eq!(
            s.user_revoke_role(&AuthUserRevokeRoleRequest {
                name: "alice".into(),
                role: "other".into()
            }),
            Err(AuthError::RoleNotGranted)
        );
        assert_eq!(
            s.user_grant_role(&AuthUserGrantRoleRequest {
                user: "alice".into(),
                role: "other".into()
            }),
            Err(AuthError::RoleNotFound)
        );
        // Granting again replaces the type and keeps one entry.
        s.role_grant_permission(&AuthRoleGrantPermissionRequest {
            name: "r".into(),
            perm: Some(perm(PermType::Readwrite, "a", "")),
        })
        .unwrap();
        assert_eq!(s.roles()["r"].len(), 1);
        assert_eq!(s.check_range("alice", b"a", b"", Access::Write), Ok(()));
        // Deleting a role takes it from its users.
        s.role_delete("r").unwrap();
        assert!(s.users()["alice"].roles.is_empty());
    }

    #[test]
    fn snapshot_round_trips_and_hides_hashes_from_debug() {
        let s = store_with(vec![perm(PermType::Read, "a", "b")]);
        let restored = AuthStore::from_snapshot(Some(s.to_snapshot())).unwrap();
        assert_eq!(restored, s);
        let shown = format!("{s:?} {:?}", s.to_snapshot());
        assert!(!shown.contains(&hash()), "{shown}");
        assert!(!shown.contains("$2b$"), "{shown}");
        let request = AuthUserAddRequest {
            name: "u".into(),
            password: "secret-password".into(),
            hashed_password: hash(),
            options: None,
        };
        let shown = format!("{request:?}");
        assert!(!shown.contains("secret-password") && !shown.contains("$2b$"));
    }
}
