//! The auth state as the replicated state machine applies it: commands,
//! the re-check at apply of commands authorized at an older auth revision,
//! and snapshots.

use super::helpers::*;
use crate::auth::{AuthError, ROOT};
use crate::command::{command, CommandKind};
use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits, KvState};
use crate::pb::authpb::{permission::Type as PermType, Permission};
use crate::pb::etcdserverpb as pb;
use crate::pb::ferrypb::{AuthStamp, Command};

fn hash() -> String {
    format!("$2b$04${}", "b".repeat(53))
}

fn user_add(name: &str) -> Command {
    command(CommandKind::UserAdd(pb::AuthUserAddRequest {
        name: name.into(),
        hashed_password: hash(),
        ..Default::default()
    }))
}

fn grant_role(user: &str, role: &str) -> Command {
    command(CommandKind::UserGrantRole(pb::AuthUserGrantRoleRequest {
        user: user.into(),
        role: role.into(),
    }))
}

fn grant_perm(role: &str, kind: PermType, key: &str, range_end: &str) -> Command {
    command(CommandKind::RoleGrantPermission(
        pb::AuthRoleGrantPermissionRequest {
            name: role.into(),
            perm: Some(Permission {
                perm_type: kind as i32,
                key: key.into(),
                range_end: range_end.into(),
            }),
        },
    ))
}

fn revoke_perm(role: &str, key: &str, range_end: &str) -> Command {
    command(CommandKind::RoleRevokePermission(
        pb::AuthRoleRevokePermissionRequest {
            role: role.into(),
            key: key.into(),
            range_end: range_end.into(),
        },
    ))
}

fn as_user(mut command: Command, user: &str, revision: u64) -> Command {
    command.auth = Some(AuthStamp {
        user: user.into(),
        revision,
    });
    command
}

/// root (with the root role) and alice (role "app": readwrite on "app/"),
/// auth on.
fn machine_with_auth() -> Machine {
    let mut m = Machine::new();
    m.ok(user_add(ROOT));
    m.ok(grant_role(ROOT, ROOT));
    m.ok(user_add("alice"));
    m.ok(command(CommandKind::RoleAdd(pb::AuthRoleAddRequest {
        name: "app".into(),
    })));
    m.ok(grant_perm("app", PermType::Readwrite, "app/", "app0"));
    m.ok(grant_role("alice", "app"));
    m.ok(command(CommandKind::AuthEnable(pb::AuthEnableRequest {})));
    m
}

#[test]
fn auth_commands_change_the_state_and_raise_its_revision() {
    let m = machine_with_auth();
    let auth = m.kv.auth();
    assert!(auth.enabled());
    // 1 to start, and seven changes.
    assert_eq!(auth.revision(), 8);
    assert!(auth.users()["alice"].roles.contains("app"));
    // Auth changes do not move the key-value revision.
    assert_eq!(m.revision(), 1);
}

#[test]
fn a_command_checked_before_a_revoke_is_checked_again_at_apply() {
    let mut m = machine_with_auth();
    let revision = m.kv.auth().revision();
    // Authorized at `revision`...
    let put = as_user(put_cmd("app/1", "v"), "alice", revision);
    assert_eq!(m.kv.authorize("alice", &put), Ok(()));
    // ... but the permission goes before the entry applies.
    m.ok(revoke_perm("app", "app/", "app0"));
    let applied = m.apply(put);
    assert_eq!(
        applied.response,
        Err(KvError::Auth(AuthError::PermissionDenied))
    );
    assert_eq!(m.get("app/1"), None);
}

#[test]
fn a_command_checked_at_the_current_revision_is_not_checked_again() {
    let mut m = machine_with_auth();
    let revision = m.kv.auth().revision();
    let put = as_user(put_cmd("app/1", "v"), "alice", revision);
    assert!(matches!(m.ok(put), CommandResponse::Put(_)));
}

#[test]
fn a_txn_whose_else_branch_writes_outside_the_grant_is_refused() {
    let m = machine_with_auth();
    let txn = txn_cmd(pb::TxnRequest {
        compare: vec![],
        success: vec![op_put("app/1", "v")],
        failure: vec![op_put("other", "v")],
    });
    assert_eq!(
        m.kv.authorize("alice", &txn),
        Err(KvError::Auth(AuthError::PermissionDenied))
    );
    // A compare reads: outside the grant it is refused as well.
    let txn = txn_cmd(pb::TxnRequest {
        compare: vec![cmp(
            "other",
            pb::compare::CompareResult::Equal,
            pb::compare::TargetUnion::Version(0),
        )],
        success: vec![op_put("app/1", "v")],
        failure: vec![],
    });
    assert!(m.kv.authorize("alice", &txn).is_err());
    // Nested txns are checked whole too.
    let txn = txn_cmd(pb::TxnRequest {
        compare: vec![],
        success: vec![op_txn(pb::TxnRequest {
            compare: vec![],
            success: vec![],
            failure: vec![op_delete("a", "z")],
        })],
        failure: vec![],
    });
    assert!(m.kv.authorize("alice", &txn).is_err());
    let txn = txn_cmd(pb::TxnRequest {
        compare: vec![],
        success: vec![op_put("app/1", "v"), op_range("app/", "app0")],
        failure: vec![op_delete("app/2", "")],
    });
    assert_eq!(m.kv.authorize("alice", &txn), Ok(()));
    assert_eq!(m.kv.authorize(ROOT, &txn), Ok(()));
}

#[test]
fn admin_commands_need_root_and_a_user_may_change_its_own_password() {
    let m = machine_with_auth();
    let add = user_add("bob");
    assert_eq!(
        m.kv.authorize("alice", &add),
        Err(KvError::Auth(AuthError::PermissionDenied))
    );
    assert_eq!(
        m.kv.authorize("", &add),
        Err(KvError::Auth(AuthError::UserEmpty))
    );
    assert_eq!(m.kv.authorize(ROOT, &add), Ok(()));
    assert!(m.kv.authorize("alice", &compact_cmd(1)).is_err());
    let change = |name: &str| {
        command(CommandKind::UserChangePassword(
            pb::AuthUserChangePasswordRequest {
                name: name.into(),
                hashed_password: hash(),
                ..Default::default()
            },
        ))
    };
    assert_eq!(m.kv.authorize("alice", &change("alice")), Ok(()));
    assert!(m.kv.authorize("alice", &change(ROOT)).is_err());
}

#[test]
fn lease_revoke_and_lease_puts_need_write_on_the_leases_keys() {
    let mut m = machine_with_auth();
    m.ok(grant_cmd(7, 60));
    m.ok(put_lease_cmd("secret", "v", 7));
    assert_eq!(
        m.kv.authorize("alice", &revoke_cmd(7)),
        Err(KvError::Auth(AuthError::PermissionDenied))
    );
    assert!(m
        .kv
        .authorize("alice", &put_lease_cmd("app/1", "v", 7))
        .is_err());
    assert_eq!(m.kv.authorize("alice", &grant_cmd(8, 60)), Ok(()));
    assert_eq!(m.kv.authorize(ROOT, &revoke_cmd(7)), Ok(()));
}

#[test]
fn a_refused_auth_command_answers_the_same_error_everywhere() {
    let mut m = machine_with_auth();
    let applied = m.apply(user_add("alice"));
    assert_eq!(
        applied.response,
        Err(KvError::Auth(AuthError::UserAlreadyExist))
    );
    let applied = m.apply(command(CommandKind::UserDelete(
        pb::AuthUserDeleteRequest { name: ROOT.into() },
    )));
    assert_eq!(
        applied.response,
        Err(KvError::Auth(AuthError::InvalidAuthMgmt))
    );
    // A hash that is not one is refused, not stored.
    let applied = m.apply(command(CommandKind::UserAdd(pb::AuthUserAddRequest {
        name: "mallory".into(),
        hashed_password: "plain text".into(),
        ..Default::default()
    })));
    assert!(matches!(
        applied.response,
        Err(KvError::Auth(AuthError::Bound { .. }))
    ));
}

#[test]
fn snapshots_hold_the_auth_state_byte_for_byte() {
    let mut m = machine_with_auth();
    m.ok(put_cmd("app/1", "v"));
    let bytes = m.kv.snapshot().unwrap();
    let restored = KvState::restore(&bytes, KvLimits::default()).unwrap();
    assert_eq!(restored, m.kv);
    assert_eq!(restored.snapshot().unwrap(), bytes);
    assert_eq!(restored.auth(), m.kv.auth());
    // Two members that applied the same commands write the same bytes.
    let mut other = machine_with_auth();
    other.ok(put_cmd("app/1", "v"));
    assert_eq!(other.kv.snapshot().unwrap(), bytes);
}
