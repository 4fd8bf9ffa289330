//! ferry-storage
