//! Simple tokens handed out through the log: every replica that applies
//! the entry holds the token, refuses it once the auth state moved under
//! it, and forgets it when its user's password changes, the user goes or
//! auth is disabled. A log replayed after a restart brings back only the
//! tokens whose time has not run out.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::auth::{AuthError, ROOT};
use crate::auth_token::{Issued, Tokens};
use crate::command::{command, encode_command, CommandKind};
use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits};
use crate::pb::etcdserverpb as pb;
use crate::pb::ferrypb::{AuthTokenCommand, Command};
use crate::state::StateMachine;
use crate::watch::WatchLimits;

/// A replica: the state machine and the index of its last entry.
struct Replica {
    machine: StateMachine,
    index: u64,
}

impl Replica {
    fn new() -> Replica {
        Replica {
            machine: StateMachine::new(KvLimits::default(), WatchLimits::default()),
            index: 0,
        }
    }

    /// Applies one entry through the codec, as the log hands it over.
    fn apply(&mut self, command: &Command) -> Result<CommandResponse, KvError> {
        self.index += 1;
        self.machine
            .apply_bytes(self.index, &encode_command(command))
            .response
    }

    /// Who `token` names here.
    fn resolve(&self, token: &str) -> Result<String, AuthError> {
        self.machine.tokens.resolve(token, self.machine.kv().auth())
    }
}

fn user_add(name: &str, hash: &str) -> Command {
    command(CommandKind::UserAdd(pb::AuthUserAddRequest {
        name: name.into(),
        hashed_password: hash.into(),
        ..Default::default()
    }))
}

fn password_hash(tag: char) -> String {
    format!("$2b$04${}", tag.to_string().repeat(53))
}

/// The log every replica applies first: root and alice, auth on.
fn auth_log() -> Vec<Command> {
    vec![
        user_add(ROOT, &password_hash('r')),
        command(CommandKind::UserGrantRole(pb::AuthUserGrantRoleRequest {
            user: ROOT.into(),
            role: ROOT.into(),
        })),
        user_add("alice", &password_hash('a')),
        command(CommandKind::AuthEnable(pb::AuthEnableRequest {})),
    ]
}

fn replicas(count: usize) -> Vec<Replica> {
    let log = auth_log();
    (0..count)
        .map(|_| {
            let mut replica = Replica::new();
            for entry in &log {
                replica.apply(entry).expect("the auth log applies");
            }
            replica
        })
        .collect()
}

fn unix_now_ms() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    u64::try_from(since.as_millis()).unwrap()
}

/// The command a member's provider makes for `user` at `revision`.
fn issue(user: &str, revision: u64) -> AuthTokenCommand {
    match Tokens::simple(Duration::from_secs(300)).issue(user, revision) {
        Ok(Issued::Replicate(assign)) => assign,
        Ok(Issued::Signed(_)) => panic!("simple tokens go through the log"),
        Err(error) => panic!("cannot issue: {error}"),
    }
}

fn assign(token: &AuthTokenCommand) -> Command {
    command(CommandKind::AuthToken(token.clone()))
}

#[test]
fn a_token_handed_out_through_the_log_is_held_by_every_replica() {
    let mut cluster = replicas(3);
    let revision = cluster[0].machine.kv().auth().revision();
    let token = issue("alice", revision);
    for replica in &cluster {
        assert_eq!(
            replica.resolve(&token.token),
            Err(AuthError::InvalidAuthToken),
            "not before the entry applies"
        );
    }
    for replica in &mut cluster {
        let answer = replica.apply(&assign(&token)).unwrap();
        assert!(matches!(answer, CommandResponse::TokenAssigned(t) if t.user == "alice"));
    }
    for replica in &cluster {
        assert_eq!(replica.resolve(&token.token).as_deref(), Ok("alice"));
        assert_eq!(replica.machine.tokens.len(), 1);
    }
    // The token is not replicated state: the snapshot does not hold it.
    let mut restored = Replica::new();
    restored
        .machine
        .restore(&cluster[0].machine.snapshot().unwrap())
        .unwrap();
    assert_eq!(
        restored.resolve(&token.token),
        Err(AuthError::InvalidAuthToken)
    );
    assert_eq!(
        restored.machine.snapshot().unwrap(),
        cluster[0].machine.snapshot().unwrap(),
        "tokens do not change the snapshot"
    );
}

#[test]
fn a_token_checked_before_the_auth_state_moved_is_refused_on_every_replica() {
    let mut cluster = replicas(2);
    let revision = cluster[0].machine.kv().auth().revision();
    let token = issue("alice", revision);
    // The password changes between the check and the apply.
    let change = command(CommandKind::UserChangePassword(
        pb::AuthUserChangePasswordRequest {
            name: "alice".into(),
            hashed_password: password_hash('b'),
            ..Default::default()
        },
    ));
    for replica in &mut cluster {
        replica.apply(&change).unwrap();
        assert_eq!(
            replica.apply(&assign(&token)),
            Err(KvError::Auth(AuthError::AuthOldRevision))
        );
        assert_eq!(
            replica.resolve(&token.token),
            Err(AuthError::InvalidAuthToken)
        );
        assert!(replica.machine.tokens.is_empty());
    }
}

#[test]
fn a_password_change_a_deleted_user_or_auth_disable_ends_tokens_everywhere() {
    let mut cluster = replicas(2);
    let held = |cluster: &mut Vec<Replica>, user: &str| {
        let revision = cluster[0].machine.kv().auth().revision();
        let token = issue(user, revision);
        for replica in cluster.iter_mut() {
            replica.apply(&assign(&token)).unwrap();
            assert!(replica.resolve(&token.token).is_ok());
        }
        token.token
    };
    let alice = held(&mut cluster, "alice");
    let root = held(&mut cluster, ROOT);
    let change = command(CommandKind::UserChangePassword(
        pb::AuthUserChangePasswordRequest {
            name: "alice".into(),
            hashed_password: password_hash('c'),
            ..Default::default()
        },
    ));
    for replica in &mut cluster {
        replica.apply(&change).unwrap();
        assert_eq!(replica.resolve(&alice), Err(AuthError::InvalidAuthToken));
        assert_eq!(replica.resolve(&root).as_deref(), Ok(ROOT));
    }
    // Deleted, then added again with the very same hash: the old token
    // stays dead.
    let alice = held(&mut cluster, "alice");
    let delete = command(CommandKind::UserDelete(pb::AuthUserDeleteRequest {
        name: "alice".into(),
    }));
    for replica in &mut cluster {
        replica.apply(&delete).unwrap();
        replica
            .apply(&user_add("alice", &password_hash('c')))
            .unwrap();
        assert_eq!(replica.resolve(&alice), Err(AuthError::InvalidAuthToken));
    }
    let disable = command(CommandKind::AuthDisable(pb::AuthDisableRequest {}));
    for replica in &mut cluster {
        replica.apply(&disable).unwrap();
        assert!(replica.machine.tokens.is_empty());
    }
}

#[test]
fn a_replayed_log_brings_back_only_the_tokens_whose_time_has_not_run_out() {
    let mut log = auth_log();
    let revision = {
        let mut replica = Replica::new();
        for entry in &log {
            replica.apply(entry).unwrap();
        }
        replica.machine.kv().auth().revision()
    };
    let live = issue("alice", revision);
    let mut expired = issue("alice", revision);
    expired.expires_unix_ms = unix_now_ms().saturating_sub(1);
    // A TTL from the log far beyond any sane one cannot overflow a deadline.
    let mut huge = issue(ROOT, revision);
    huge.expires_unix_ms = u64::MAX;
    huge.ttl_ms = u64::MAX;
    log.extend([assign(&live), assign(&expired), assign(&huge)]);

    // A restart: a fresh state machine replays the same entries.
    let mut restarted = Replica::new();
    for entry in &log {
        restarted.apply(entry).unwrap();
    }
    assert_eq!(restarted.resolve(&live.token).as_deref(), Ok("alice"));
    assert_eq!(
        restarted.resolve(&expired.token),
        Err(AuthError::InvalidAuthToken)
    );
    assert_eq!(restarted.resolve(&huge.token).as_deref(), Ok(ROOT));
}

#[test]
fn a_token_for_an_unknown_user_or_with_auth_off_is_refused_at_apply() {
    let mut cluster = replicas(1);
    let revision = cluster[0].machine.kv().auth().revision();
    let nobody = issue("nobody", revision);
    assert_eq!(
        cluster[0].apply(&assign(&nobody)),
        Err(KvError::Auth(AuthError::AuthFailed))
    );
    let mut off = Replica::new();
    let token = issue("alice", 1);
    assert_eq!(
        off.apply(&assign(&token)),
        Err(KvError::Auth(AuthError::AuthNotEnabled))
    );
    let mut oversized = issue("alice", revision);
    oversized.token = "x".repeat(crate::auth_token::TOKEN_BYTES_MAX + 1);
    assert_eq!(
        cluster[0].apply(&assign(&oversized)),
        Err(KvError::Auth(AuthError::AuthFailed))
    );
    assert!(cluster[0].machine.tokens.is_empty());
}
