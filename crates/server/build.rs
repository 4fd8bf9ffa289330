//! Compiles our etcd v3 .proto definitions with protox (pure Rust, no system
//! `protoc`) and generates prost messages plus tonic server and client code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/mvccpb/kv.proto",
        "proto/etcdserverpb/rpc.proto",
        "proto/ferrypb/command.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
