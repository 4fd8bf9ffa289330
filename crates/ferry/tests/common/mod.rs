//! What the process tests (cluster.rs, tls.rs) share.

use ferry_server::pb::authpb::{permission::Type as PermType, Permission};
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::auth_client::AuthClient;
use tonic::transport::Channel;

#[path = "../../../runtime/tests/support/ports.rs"]
mod ports;
pub use ports::free_port;

/// Turns auth on through `auth`: `root` (password `root-pw`, the root
/// role) and `user` (password `USER-pw`) with a role `role` that grants
/// `access` on the prefix `app/`.
pub async fn enable_auth_with_app_user(
    auth: &mut AuthClient<Channel>,
    user: &str,
    role: &str,
    access: PermType,
) {
    for name in ["root", user] {
        auth.user_add(pb::AuthUserAddRequest {
            name: name.into(),
            password: format!("{name}-pw"),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    auth.user_grant_role(pb::AuthUserGrantRoleRequest {
        user: "root".into(),
        role: "root".into(),
    })
    .await
    .unwrap();
    auth.role_add(pb::AuthRoleAddRequest { name: role.into() })
        .await
        .unwrap();
    auth.role_grant_permission(pb::AuthRoleGrantPermissionRequest {
        name: role.into(),
        perm: Some(Permission {
            perm_type: access as i32,
            key: "app/".into(),
            range_end: "app0".into(),
        }),
    })
    .await
    .unwrap();
    auth.user_grant_role(pb::AuthUserGrantRoleRequest {
        user: user.into(),
        role: role.into(),
    })
    .await
    .unwrap();
    auth.auth_enable(pb::AuthEnableRequest {}).await.unwrap();
}
