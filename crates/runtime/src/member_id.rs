//! Member ids as people read them: in hexadecimal, as etcdctl prints them
//! and as `ferry serve --id` takes them.

use std::fmt;

/// Displays a member id (or `none`) in hexadecimal, for logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hex<T>(pub T);

impl fmt::Display for Hex<u64> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl fmt::Display for Hex<Option<u64>> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(id) => write!(f, "{id:x}"),
            None => f.write_str("none"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Hex;

    #[test]
    fn ids_read_as_etcdctl_prints_them() {
        assert_eq!(
            Hex(0x8e9e_05c5_2164_694d_u64).to_string(),
            "8e9e05c52164694d"
        );
        assert_eq!(Hex(Some(10u64)).to_string(), "a");
        assert_eq!(Hex(None::<u64>).to_string(), "none");
    }
}
