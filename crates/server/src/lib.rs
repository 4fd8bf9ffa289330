//! ferry-server
