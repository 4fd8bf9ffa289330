//! End-to-end tests of authentication and authorization over gRPC: every
//! Auth call, each permission form, and the refusals clients match on (the
//! texts and codes are etcd's).

mod common;

use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::{ApiOptions, AuthOptions};
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::KvLimits;
use ferry_server::pb::authpb::{permission::Type as PermType, Permission, UserAddOptions};
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::auth_client::AuthClient;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::lease_client::LeaseClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::watch::WatchLimits;
use tokio::sync::{mpsc, oneshot};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

struct Server {
    channel: Channel,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start() -> Server {
        Server::start_with(AuthOptions {
            // The fastest cost bcrypt allows: the tests check behaviour.
            bcrypt_cost: 4,
            ..AuthOptions::default()
        })
        .await
    }

    async fn start_with(auth: AuthOptions) -> Server {
        let backend = Arc::new(LocalBackend::new(
            KvLimits {
                lease_ttl_seconds_min: 1,
                ..KvLimits::default()
            },
            WatchLimits::default(),
            "http://127.0.0.1:0".to_string(),
        ));
        let options = ApiOptions {
            auth,
            ..ApiOptions::default()
        };
        let server = common::start(backend, options).await;
        Server {
            channel: common::connect(server.address).await,
            _stop: server.stop,
        }
    }

    fn auth(&self) -> AuthClient<Channel> {
        AuthClient::new(self.channel.clone())
    }
    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
    }

    /// root (password "rootpw") with the root role, auth on; root's token.
    async fn enable_auth(&self) -> String {
        let mut auth = self.auth();
        auth.user_add(user_add("root", "rootpw")).await.unwrap();
        auth.user_grant_role(pb::AuthUserGrantRoleRequest {
            user: "root".into(),
            role: "root".into(),
        })
        .await
        .unwrap();
        auth.auth_enable(pb::AuthEnableRequest {}).await.unwrap();
        self.login("root", "rootpw").await.unwrap()
    }

    async fn login(&self, name: &str, password: &str) -> Result<String, Status> {
        self.auth()
            .authenticate(pb::AuthenticateRequest {
                name: name.into(),
                password: password.into(),
            })
            .await
            .map(|r| r.into_inner().token)
    }

    /// A user `name` (password "pw") with one role `name-role` holding
    /// `perms`; its token.
    async fn user_with(&self, root: &str, name: &str, perms: Vec<Permission>) -> String {
        let mut auth = self.auth();
        let role = format!("{name}-role");
        auth.user_add(as_user(user_add(name, "pw"), root))
            .await
            .unwrap();
        auth.role_add(as_user(pb::AuthRoleAddRequest { name: role.clone() }, root))
            .await
            .unwrap();
        for perm in perms {
            auth.role_grant_permission(as_user(
                pb::AuthRoleGrantPermissionRequest {
                    name: role.clone(),
                    perm: Some(perm),
                },
                root,
            ))
            .await
            .unwrap();
        }
        auth.user_grant_role(as_user(
            pb::AuthUserGrantRoleRequest {
                user: name.into(),
                role,
            },
            root,
        ))
        .await
        .unwrap();
        self.login(name, "pw").await.unwrap()
    }
}

fn user_add(name: &str, password: &str) -> pb::AuthUserAddRequest {
    pb::AuthUserAddRequest {
        name: name.into(),
        password: password.into(),
        ..Default::default()
    }
}

fn perm(kind: PermType, key: &str, range_end: &str) -> Permission {
    Permission {
        perm_type: kind as i32,
        key: key.into(),
        range_end: range_end.into(),
    }
}

/// `message` with the token in the metadata, as etcd's clients send it.
fn as_user<T>(message: T, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("token", token.parse().unwrap());
    request
}

fn put(key: &str, value: &str) -> pb::PutRequest {
    pb::PutRequest {
        key: key.to_owned().into(),
        value: value.to_owned().into(),
        ..Default::default()
    }
}

fn range(key: &str, range_end: &str) -> pb::RangeRequest {
    pb::RangeRequest {
        key: key.into(),
        range_end: range_end.into(),
        ..Default::default()
    }
}

fn op_put(key: &str, value: &str) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(pb::request_op::Request::RequestPut(put(key, value))),
    }
}

#[track_caller]
fn assert_status(result: Result<impl std::fmt::Debug, Status>, code: Code, message: &str) {
    let status = result.expect_err("the call should fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(status.message(), message);
}

const DENIED: &str = "etcdserver: permission denied";

#[tokio::test]
async fn enabling_auth_needs_a_root_user_with_the_root_role() {
    let server = Server::start().await;
    let mut auth = server.auth();
    assert_status(
        auth.auth_enable(pb::AuthEnableRequest {}).await,
        Code::FailedPrecondition,
        "etcdserver: root user does not exist",
    );
    auth.user_add(user_add("root", "rootpw")).await.unwrap();
    assert_status(
        auth.auth_enable(pb::AuthEnableRequest {}).await,
        Code::FailedPrecondition,
        "etcdserver: root user does not have root role",
    );
    // etcdctl's `auth enable` then adds the role and grants it.
    auth.role_add(pb::AuthRoleAddRequest {
        name: "root".into(),
    })
    .await
    .unwrap();
    auth.user_grant_role(pb::AuthUserGrantRoleRequest {
        user: "root".into(),
        role: "root".into(),
    })
    .await
    .unwrap();
    let before = auth
        .auth_status(pb::AuthStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!before.enabled);
    auth.auth_enable(pb::AuthEnableRequest {}).await.unwrap();
    let after = auth
        .auth_status(pb::AuthStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(after.enabled);
    assert_eq!(after.auth_revision, before.auth_revision + 1);
    assert!(after.header.is_some());
    // Without a token, a key request has no user.
    assert_status(
        server.kv().range(range("a", "")).await,
        Code::InvalidArgument,
        "etcdserver: user name is empty",
    );
    // Root cannot be removed while auth is on.
    let root = server.login("root", "rootpw").await.unwrap();
    assert_status(
        auth.user_delete(as_user(
            pb::AuthUserDeleteRequest {
                name: "root".into(),
            },
            &root,
        ))
        .await,
        Code::InvalidArgument,
        "etcdserver: invalid auth management",
    );
    // Disabling needs root; then everyone is served again.
    assert_status(
        auth.auth_disable(pb::AuthDisableRequest {}).await,
        Code::InvalidArgument,
        "etcdserver: user name is empty",
    );
    auth.auth_disable(as_user(pb::AuthDisableRequest {}, &root))
        .await
        .unwrap();
    server.kv().range(range("a", "")).await.unwrap();
}

#[tokio::test]
async fn every_user_and_role_call_answers_as_etcd_does() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let mut auth = server.auth();
    macro_rules! t {
        ($m:expr) => {
            as_user($m, &root)
        };
    }
    auth.user_add(t!(user_add("alice", "pw"))).await.unwrap();
    assert_status(
        auth.user_add(t!(user_add("alice", "pw"))).await,
        Code::FailedPrecondition,
        "etcdserver: user name already exists",
    );
    assert_status(
        auth.user_add(t!(user_add("", "pw"))).await,
        Code::InvalidArgument,
        "etcdserver: user name is empty",
    );
    assert_status(
        auth.user_add(t!(user_add("long", &"p".repeat(73)))).await,
        Code::InvalidArgument,
        "ferry: a password must be shorter (bcrypt reads only its first 72 bytes) (limit 72)",
    );
    auth.role_add(t!(pb::AuthRoleAddRequest { name: "r".into() }))
        .await
        .unwrap();
    assert_status(
        auth.role_add(t!(pb::AuthRoleAddRequest { name: "r".into() }))
            .await,
        Code::FailedPrecondition,
        "etcdserver: role name already exists",
    );
    assert_status(
        auth.role_add(t!(pb::AuthRoleAddRequest { name: "".into() }))
            .await,
        Code::InvalidArgument,
        "etcdserver: role name is empty",
    );
    auth.role_grant_permission(t!(pb::AuthRoleGrantPermissionRequest {
        name: "r".into(),
        perm: Some(perm(PermType::Read, "k", "")),
    }))
    .await
    .unwrap();
    assert_status(
        auth.role_grant_permission(t!(pb::AuthRoleGrantPermissionRequest {
            name: "r".into(),
            perm: None,
        }))
        .await,
        Code::InvalidArgument,
        "etcdserver: permission not given",
    );
    let role = auth
        .role_get(t!(pb::AuthRoleGetRequest { role: "r".into() }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(role.perm, vec![perm(PermType::Read, "k", "")]);
    assert_status(
        auth.role_get(t!(pb::AuthRoleGetRequest {
            role: "nope".into(),
        }))
        .await,
        Code::FailedPrecondition,
        "etcdserver: role name not found",
    );
    let roles = auth
        .role_list(t!(pb::AuthRoleListRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(roles.roles, vec!["r".to_string()]);
    auth.user_grant_role(t!(pb::AuthUserGrantRoleRequest {
        user: "alice".into(),
        role: "r".into(),
    }))
    .await
    .unwrap();
    assert_status(
        auth.user_grant_role(t!(pb::AuthUserGrantRoleRequest {
            user: "nobody".into(),
            role: "r".into(),
        }))
        .await,
        Code::FailedPrecondition,
        "etcdserver: user name not found",
    );
    let alice = auth
        .user_get(t!(pb::AuthUserGetRequest {
            name: "alice".into(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(alice.roles, vec!["r".to_string()]);
    let users = auth
        .user_list(t!(pb::AuthUserListRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(users.users, vec!["alice".to_string(), "root".to_string()]);
    // alice may read itself and its role, not others or the lists.
    let alice_token = server.login("alice", "pw").await.unwrap();
    macro_rules! a {
        ($m:expr) => {
            as_user($m, &alice_token)
        };
    }
    auth.user_get(a!(pb::AuthUserGetRequest {
        name: "alice".into(),
    }))
    .await
    .unwrap();
    auth.role_get(a!(pb::AuthRoleGetRequest { role: "r".into() }))
        .await
        .unwrap();
    assert_status(
        auth.user_list(a!(pb::AuthUserListRequest {})).await,
        Code::PermissionDenied,
        DENIED,
    );
    assert_status(
        auth.user_add(a!(user_add("eve", "pw"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    assert_status(
        auth.role_revoke_permission(t!(pb::AuthRoleRevokePermissionRequest {
            role: "r".into(),
            key: b"other".to_vec(),
            range_end: vec![],
        }))
        .await,
        Code::FailedPrecondition,
        "etcdserver: permission is not granted to the role",
    );
    auth.role_revoke_permission(t!(pb::AuthRoleRevokePermissionRequest {
        role: "r".into(),
        key: b"k".to_vec(),
        range_end: vec![],
    }))
    .await
    .unwrap();
    auth.user_revoke_role(t!(pb::AuthUserRevokeRoleRequest {
        name: "alice".into(),
        role: "r".into(),
    }))
    .await
    .unwrap();
    assert_status(
        auth.user_revoke_role(t!(pb::AuthUserRevokeRoleRequest {
            name: "alice".into(),
            role: "r".into(),
        }))
        .await,
        Code::FailedPrecondition,
        "etcdserver: role is not granted to the user",
    );
    auth.role_delete(t!(pb::AuthRoleDeleteRequest { role: "r".into() }))
        .await
        .unwrap();
    auth.user_delete(t!(pb::AuthUserDeleteRequest {
        name: "alice".into(),
    }))
    .await
    .unwrap();
    assert_status(
        auth.user_delete(t!(pb::AuthUserDeleteRequest {
            name: "alice".into(),
        }))
        .await,
        Code::FailedPrecondition,
        "etcdserver: user name not found",
    );
    // Its token died with it.
    assert_status(
        server
            .kv()
            .range(as_user(range("k", ""), &alice_token))
            .await,
        Code::Unauthenticated,
        "etcdserver: invalid auth token",
    );
}

#[tokio::test]
async fn wrong_password_missing_and_bad_tokens_get_etcds_errors() {
    let server = Server::start().await;
    assert_status(
        server.login("root", "x").await,
        Code::FailedPrecondition,
        "etcdserver: authentication is not enabled",
    );
    let root = server.enable_auth().await;
    let failed = "etcdserver: authentication failed, invalid user ID or password";
    assert_status(
        server.login("root", "wrong").await,
        Code::InvalidArgument,
        failed,
    );
    assert_status(
        server.login("nobody", "rootpw").await,
        Code::InvalidArgument,
        failed,
    );
    assert_status(server.login("", "").await, Code::InvalidArgument, failed);
    // A no-password user cannot authenticate with a password.
    server
        .auth()
        .user_add(as_user(
            pb::AuthUserAddRequest {
                name: "cert-only".into(),
                options: Some(UserAddOptions { no_password: true }),
                ..Default::default()
            },
            &root,
        ))
        .await
        .unwrap();
    assert_status(
        server.login("cert-only", "").await,
        Code::InvalidArgument,
        failed,
    );
    assert_status(
        server.kv().put(put("a", "1")).await,
        Code::InvalidArgument,
        "etcdserver: user name is empty",
    );
    assert_status(
        server.kv().put(as_user(put("a", "1"), "made.up")).await,
        Code::Unauthenticated,
        "etcdserver: invalid auth token",
    );
    server
        .kv()
        .put(as_user(put("a", "1"), &root))
        .await
        .unwrap();
    // The `authorization` key works too (etcd's gateway sends it).
    let mut request = Request::new(range("a", ""));
    request
        .metadata_mut()
        .insert("authorization", root.parse().unwrap());
    assert_eq!(
        server.kv().range(request).await.unwrap().into_inner().count,
        1
    );
}

#[tokio::test]
async fn an_expired_token_is_invalid_and_a_fresh_one_works() {
    let server = Server::start_with(AuthOptions {
        bcrypt_cost: 4,
        token_ttl: Duration::from_millis(300),
        ..AuthOptions::default()
    })
    .await;
    let root = server.enable_auth().await;
    server
        .kv()
        .range(as_user(range("a", ""), &root))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_status(
        server.kv().range(as_user(range("a", ""), &root)).await,
        Code::Unauthenticated,
        "etcdserver: invalid auth token",
    );
    let fresh = server.login("root", "rootpw").await.unwrap();
    server
        .kv()
        .range(as_user(range("a", ""), &fresh))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_password_change_ends_the_old_tokens() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let alice = server
        .user_with(&root, "alice", vec![perm(PermType::Read, "a", "")])
        .await;
    server
        .kv()
        .range(as_user(range("a", ""), &alice))
        .await
        .unwrap();
    // alice changes its own password.
    server
        .auth()
        .user_change_password(as_user(
            pb::AuthUserChangePasswordRequest {
                name: "alice".into(),
                password: "new".into(),
                ..Default::default()
            },
            &alice,
        ))
        .await
        .unwrap();
    assert_status(
        server.kv().range(as_user(range("a", ""), &alice)).await,
        Code::Unauthenticated,
        "etcdserver: invalid auth token",
    );
    assert!(server.login("alice", "pw").await.is_err());
    let again = server.login("alice", "new").await.unwrap();
    server
        .kv()
        .range(as_user(range("a", ""), &again))
        .await
        .unwrap();
}

#[tokio::test]
async fn each_permission_form_grants_what_it_says() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let user = server
        .user_with(
            &root,
            "u",
            vec![
                // One key, read only.
                perm(PermType::Read, "b1", ""),
                // A prefix, read and write (etcdctl's --prefix).
                perm(PermType::Readwrite, "app/", "app0"),
                // A range, write only.
                perm(PermType::Write, "m", "p"),
                // From a key on, read only (etcdctl's --from-key).
                perm(PermType::Read, "x", "\0"),
            ],
        )
        .await;
    let mut kv = server.kv();
    macro_rules! u {
        ($m:expr) => {
            as_user($m, &user)
        };
    }
    kv.range(u!(range("b1", ""))).await.unwrap();
    assert_status(
        kv.put(u!(put("b1", "v"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.put(u!(put("app/1", "v"))).await.unwrap();
    kv.range(u!(range("app/", "app0"))).await.unwrap();
    assert_status(
        kv.range(u!(range("app", "app0"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.put(u!(put("n", "v"))).await.unwrap();
    assert_status(
        kv.range(u!(range("n", ""))).await,
        Code::PermissionDenied,
        DENIED,
    );
    assert_status(
        kv.put(u!(put("p", "v"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.range(u!(range("x", "\0"))).await.unwrap();
    kv.range(u!(range("zzz", ""))).await.unwrap();
    assert_status(
        kv.put(u!(put("y", "v"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    // A put asking for the previous value reads it as well.
    assert_status(
        kv.put(u!(pb::PutRequest {
            prev_kv: true,
            ..put("n", "v")
        }))
        .await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.delete_range(u!(pb::DeleteRangeRequest {
        key: "m".into(),
        range_end: "p".into(),
        prev_kv: false,
    }))
    .await
    .unwrap();
    assert_status(
        kv.delete_range(u!(pb::DeleteRangeRequest {
            key: "m".into(),
            range_end: "q".into(),
            prev_kv: false,
        }))
        .await,
        Code::PermissionDenied,
        DENIED,
    );
    // The whole keyspace needs root.
    assert_status(
        kv.range(u!(range("\0", "\0"))).await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.range(as_user(range("\0", "\0"), &root)).await.unwrap();
}

#[tokio::test]
async fn a_txn_whose_else_branch_writes_outside_the_grant_is_denied() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let user = server
        .user_with(&root, "u", vec![perm(PermType::Readwrite, "app/", "app0")])
        .await;
    let mut kv = server.kv();
    let txn = pb::TxnRequest {
        compare: vec![],
        success: vec![op_put("app/1", "v")],
        failure: vec![op_put("elsewhere", "v")],
    };
    // The else branch would not run, but it is checked all the same.
    assert_status(
        kv.txn(as_user(txn, &user)).await,
        Code::PermissionDenied,
        DENIED,
    );
    let txn = pb::TxnRequest {
        compare: vec![],
        success: vec![op_put("app/1", "v")],
        failure: vec![op_put("app/2", "v")],
    };
    assert!(
        kv.txn(as_user(txn, &user))
            .await
            .unwrap()
            .into_inner()
            .succeeded
    );
    let range = kv
        .range(as_user(range("elsewhere", ""), &root))
        .await
        .unwrap();
    assert_eq!(range.into_inner().count, 0);
}

#[tokio::test]
async fn a_role_revoked_while_a_watch_is_open_ends_the_watch() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let user = server
        .user_with(&root, "w", vec![perm(PermType::Read, "app/", "app0")])
        .await;
    let (requests, receiver) = mpsc::channel(8);
    let mut responses = WatchClient::new(server.channel.clone())
        .watch(as_user(ReceiverStream::new(receiver), &user))
        .await
        .unwrap()
        .into_inner();
    let create = |key: &str, range_end: &str| pb::WatchRequest {
        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
            pb::WatchCreateRequest {
                key: key.into(),
                range_end: range_end.into(),
                ..Default::default()
            },
        )),
    };
    // Outside the grant: created and cancelled at once, as etcd answers.
    requests.send(create("secret", "")).await.unwrap();
    let refused = responses.message().await.unwrap().unwrap();
    assert!(refused.created && refused.canceled);
    assert_eq!(refused.watch_id, -1);
    assert!(refused.cancel_reason.contains(DENIED), "{refused:?}");
    requests.send(create("app/", "app0")).await.unwrap();
    let created = responses.message().await.unwrap().unwrap();
    assert!(created.created && !created.canceled);
    let mut kv = server.kv();
    kv.put(as_user(put("app/1", "a"), &root)).await.unwrap();
    let event = responses.message().await.unwrap().unwrap();
    assert_eq!(event.events.len(), 1);
    // The role is taken away; the next write is not delivered.
    server
        .auth()
        .user_revoke_role(as_user(
            pb::AuthUserRevokeRoleRequest {
                name: "w".into(),
                role: "w-role".into(),
            },
            &root,
        ))
        .await
        .unwrap();
    kv.put(as_user(put("app/2", "b"), &root)).await.unwrap();
    let cancelled = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(cancelled.canceled, "{cancelled:?}");
    assert!(cancelled.events.is_empty());
    assert_eq!(cancelled.watch_id, created.watch_id);
    assert!(cancelled.cancel_reason.contains(DENIED));
}

#[tokio::test]
async fn compaction_maintenance_and_membership_are_root_only() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let user = server
        .user_with(&root, "u", vec![perm(PermType::Readwrite, "\0", "\0")])
        .await;
    let mut kv = server.kv();
    kv.put(as_user(put("a", "1"), &user)).await.unwrap();
    let compact = pb::CompactionRequest {
        revision: 1,
        physical: false,
    };
    assert_status(
        kv.compact(as_user(compact, &user)).await,
        Code::PermissionDenied,
        DENIED,
    );
    kv.compact(as_user(compact, &root)).await.unwrap();
    let mut maintenance = MaintenanceClient::new(server.channel.clone());
    assert_status(
        maintenance
            .hash_kv(as_user(pb::HashKvRequest { revision: 0 }, &user))
            .await,
        Code::PermissionDenied,
        DENIED,
    );
    maintenance
        .hash_kv(as_user(pb::HashKvRequest { revision: 0 }, &root))
        .await
        .unwrap();
    // Status and the alarm list stay open: etcdctl's health checks use them.
    maintenance.status(pb::StatusRequest {}).await.unwrap();
    maintenance
        .alarm(as_user(pb::AlarmRequest::default(), &user))
        .await
        .unwrap();
    let mut cluster =
        ferry_server::pb::etcdserverpb::cluster_client::ClusterClient::new(server.channel.clone());
    assert_status(
        cluster
            .member_remove(as_user(pb::MemberRemoveRequest { id: 1 }, &user))
            .await,
        Code::PermissionDenied,
        DENIED,
    );
    cluster
        .member_list(pb::MemberListRequest::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn lease_calls_that_touch_keys_are_checked() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let user = server
        .user_with(&root, "u", vec![perm(PermType::Readwrite, "app/", "app0")])
        .await;
    let mut lease = LeaseClient::new(server.channel.clone());
    assert_status(
        lease
            .lease_grant(pb::LeaseGrantRequest { ttl: 60, id: 0 })
            .await,
        Code::InvalidArgument,
        "etcdserver: user name is empty",
    );
    let granted = lease
        .lease_grant(as_user(pb::LeaseGrantRequest { ttl: 60, id: 0 }, &root))
        .await
        .unwrap()
        .into_inner();
    server
        .kv()
        .put(as_user(
            pb::PutRequest {
                lease: granted.id,
                ..put("secret", "v")
            },
            &root,
        ))
        .await
        .unwrap();
    // The lease holds a key the user may not write: no revoke, no attach,
    // and its keys are not shown.
    assert_status(
        lease
            .lease_revoke(as_user(pb::LeaseRevokeRequest { id: granted.id }, &user))
            .await,
        Code::PermissionDenied,
        DENIED,
    );
    assert_status(
        server
            .kv()
            .put(as_user(
                pb::PutRequest {
                    lease: granted.id,
                    ..put("app/1", "v")
                },
                &user,
            ))
            .await,
        Code::PermissionDenied,
        DENIED,
    );
    assert_status(
        lease
            .lease_time_to_live(as_user(
                pb::LeaseTimeToLiveRequest {
                    id: granted.id,
                    keys: true,
                },
                &user,
            ))
            .await,
        Code::PermissionDenied,
        DENIED,
    );
    lease
        .lease_revoke(as_user(pb::LeaseRevokeRequest { id: granted.id }, &root))
        .await
        .unwrap();
}

#[tokio::test]
async fn password_hashes_never_leave_the_server() {
    let server = Server::start().await;
    let root = server.enable_auth().await;
    let mut auth = server.auth();
    let user = auth
        .user_get(as_user(
            pb::AuthUserGetRequest {
                name: "root".into(),
            },
            &root,
        ))
        .await
        .unwrap()
        .into_inner();
    let shown = format!("{user:?}");
    assert!(!shown.contains("$2"), "{shown}");
    // A request's Debug hides the password too.
    let shown = format!("{:?}", user_add("x", "hunter2"));
    assert!(!shown.contains("hunter2"), "{shown}");
}

fn jwt_server_options(method: &str, key: &str, ttl: &str) -> AuthOptions {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/keys");
    let config = format!(
        "jwt,pub-key={dir}/{key}.pub,priv-key={dir}/{key}.key,sign-method={method},ttl={ttl}"
    );
    AuthOptions {
        bcrypt_cost: 4,
        token: config.parse().unwrap(),
        ..AuthOptions::default()
    }
}

#[tokio::test]
async fn jwt_tokens_work_with_rs256_and_es256_and_get_old_with_the_auth_state() {
    for (method, key) in [("RS256", "rs256"), ("ES256", "es256")] {
        let server = Server::start_with(jwt_server_options(method, key, "5m")).await;
        let root = server.enable_auth().await;
        assert_eq!(root.split('.').count(), 3, "{method}: not a JWT: {root}");
        server
            .kv()
            .put(as_user(put("a", "1"), &root))
            .await
            .unwrap();
        // A forged or damaged token is invalid.
        let mut forged = root.clone();
        forged.pop();
        forged.push(if root.ends_with('A') { 'B' } else { 'A' });
        assert_status(
            server.kv().range(as_user(range("a", ""), &forged)).await,
            Code::Unauthenticated,
            "etcdserver: invalid auth token",
        );
        // Any auth change makes earlier JWTs old: clients authenticate
        // again on this error.
        server
            .auth()
            .role_add(as_user(pb::AuthRoleAddRequest { name: "r".into() }, &root))
            .await
            .unwrap();
        assert_status(
            server.kv().range(as_user(range("a", ""), &root)).await,
            Code::InvalidArgument,
            "etcdserver: revision of auth store is old",
        );
        let fresh = server.login("root", "rootpw").await.unwrap();
        server
            .kv()
            .range(as_user(range("a", ""), &fresh))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn an_expired_jwt_is_invalid() {
    let server = Server::start_with(jwt_server_options("ES256", "es256", "1s")).await;
    let root = server.enable_auth().await;
    server
        .kv()
        .range(as_user(range("a", ""), &root))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_status(
        server.kv().range(as_user(range("a", ""), &root)).await,
        Code::Unauthenticated,
        "etcdserver: invalid auth token",
    );
}
