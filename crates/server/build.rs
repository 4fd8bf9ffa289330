//! Compiles our etcd v3 .proto definitions with protox (pure Rust, no system
//! `protoc`) and generates prost messages plus tonic server and client code,
//! and serde impls of the etcd messages for the JSON gateway (pbjson).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/mvccpb/kv.proto",
        "proto/authpb/auth.proto",
        "proto/etcdserverpb/rpc.proto",
        "proto/ferrypb/command.proto",
        "proto/ferrypb/watch_wire.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    // Messages that carry a password or its hash get a hand-written Debug
    // (in `auth.rs`) that leaves it out, so that no log line, panic message
    // or error can show one.
    tonic_prost_build::configure()
        .skip_debug([
            ".etcdserverpb.AuthenticateRequest",
            ".etcdserverpb.AuthUserAddRequest",
            ".etcdserverpb.AuthUserChangePasswordRequest",
            ".authpb.User",
        ])
        // prost's codec with buffers sized for etcd's messages (see
        // `src/grpc_codec.rs`).
        .codec_path("crate::grpc_codec::EtcdCodec")
        // Keys and values as `Bytes`: a stored value is shared, not copied,
        // by every response and watch event that carries it.
        .bytes(".mvccpb.KeyValue")
        // A put's key and value as `Bytes`: decoded from a log entry (a
        // `Bytes` itself) they are slices of it, not copies, on every
        // member that applies the entry.
        .bytes(".etcdserverpb.PutRequest")
        // Encoded events, shared by every watcher's response (see
        // `proto/ferrypb/watch_wire.proto`).
        .bytes(".ferrypb.WatchResponseWire")
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors.clone())?;
    // The Watch service as the server runs it: etcd's route and requests,
    // answered with `WatchResponseWire` (the same bytes on the wire as a
    // `WatchResponse`, with each event encoded once for all its watchers).
    // Clients use the Watch client generated from `rpc.proto` above.
    let watch = tonic_build::manual::Service::builder()
        .name("Watch")
        .package("etcdserverpb")
        .method(
            tonic_build::manual::Method::builder()
                .name("watch")
                .route_name("Watch")
                .input_type("crate::pb::etcdserverpb::WatchRequest")
                .output_type("crate::pb::ferrypb::WatchResponseWire")
                // Copies events without touching their shared counts.
                .codec_path("crate::grpc_codec::WatchCodec")
                .client_streaming()
                .server_streaming()
                .build(),
        )
        .build();
    tonic_build::manual::Builder::new()
        .build_client(false)
        .compile(&[watch]);
    // serde impls of etcd's messages for the JSON gateway, with the
    // field names of the .proto files (as etcd's gateway writes them) and
    // unknown fields skipped (as it reads them).
    pbjson_build::Builder::new()
        .register_descriptors(&prost::Message::encode_to_vec(&descriptors))?
        .preserve_proto_field_names()
        .ignore_unknown_fields()
        .build(&[".etcdserverpb", ".mvccpb", ".authpb"])?;
    Ok(())
}
