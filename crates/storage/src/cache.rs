//! A bounded cache of each group's most recent entries, so that a leader
//! serves replication to followers that keep up from memory.

use std::collections::VecDeque;

use ferry_raft::{Entry, Index};

/// The most recent entries of one group, bounded by count and by bytes
/// (as [`Entry::size_bytes`] counts them). Entries are consecutive.
#[derive(Debug)]
pub struct EntryCache {
    entries: VecDeque<Entry>,
    size_bytes: u64,
    entries_max: usize,
    size_bytes_max: u64,
}

impl EntryCache {
    /// An empty cache holding at most `entries_max` entries and `size_bytes_max` bytes.
    pub fn new(entries_max: usize, size_bytes_max: u64) -> Self {
        EntryCache {
            entries: VecDeque::new(),
            size_bytes: 0,
            entries_max,
            size_bytes_max,
        }
    }

    /// The number of cached entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes the cached entries count for.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The index of the first cached entry.
    pub fn first_index(&self) -> Option<Index> {
        self.entries.front().map(|e| e.index)
    }

    /// Adds entries that follow the log's current last entry (replacing
    /// cached entries at or after the first one), then evicts the oldest
    /// entries beyond the bounds.
    pub fn append(&mut self, new: &[Entry]) {
        let Some(first) = new.first() else {
            return;
        };
        self.truncate_from(first.index);
        if let Some(last) = self.entries.back() {
            if last.index + 1 != first.index {
                // Not contiguous with what we hold (the log had entries that
                // were never cached): start over from the new ones.
                self.clear();
            }
        }
        for e in new {
            self.size_bytes += e.size_bytes();
            self.entries.push_back(e.clone());
        }
        while self.entries.len() > self.entries_max || self.size_bytes > self.size_bytes_max {
            match self.entries.pop_front() {
                Some(e) => self.size_bytes -= e.size_bytes(),
                None => break,
            }
        }
    }

    /// Drops cached entries at or after `index`.
    pub fn truncate_from(&mut self, index: Index) {
        while self.entries.back().is_some_and(|e| e.index >= index) {
            if let Some(e) = self.entries.pop_back() {
                self.size_bytes -= e.size_bytes();
            }
        }
    }

    /// Drops cached entries at or before `index`.
    pub fn drop_through(&mut self, index: Index) {
        while self.entries.front().is_some_and(|e| e.index <= index) {
            if let Some(e) = self.entries.pop_front() {
                self.size_bytes -= e.size_bytes();
            }
        }
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.size_bytes = 0;
    }

    /// Entries `lo..hi` if all of them are cached, stopping once
    /// `size_bytes_max` is reached (always at least one entry).
    pub fn get(&self, lo: Index, hi: Index, size_bytes_max: u64) -> Option<Vec<Entry>> {
        let first = self.first_index()?;
        let last = self.entries.back()?.index;
        if lo < first || hi > last + 1 || lo >= hi {
            return None;
        }
        let mut out = Vec::new();
        let mut bytes = 0u64;
        for e in self
            .entries
            .range((lo - first) as usize..(hi - first) as usize)
        {
            bytes += e.size_bytes();
            if !out.is_empty() && bytes > size_bytes_max {
                break;
            }
            out.push(e.clone());
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use ferry_raft::EntryPayload;

    fn e(index: Index, term: u64, len: usize) -> Entry {
        Entry {
            term,
            index,
            payload: EntryPayload::Command(Bytes::from(vec![0u8; len])),
        }
    }

    #[test]
    fn bounded_by_count_and_bytes() {
        let mut c = EntryCache::new(3, 1000);
        c.append(&[e(1, 1, 10), e(2, 1, 10), e(3, 1, 10), e(4, 1, 10)]);
        assert_eq!(c.len(), 3);
        assert_eq!(c.first_index(), Some(2));
        c.append(&[e(5, 1, 900)]);
        // 3 * 34 + 924 bytes: the oldest entry goes to get under 1000.
        assert_eq!(c.size_bytes(), 2 * 34 + 924);
        assert_eq!(c.first_index(), Some(3));
        assert_eq!(c.get(3, 6, 0).unwrap().len(), 1, "at least one entry");
        assert_eq!(c.get(3, 6, 100).unwrap().len(), 2);
        assert!(c.get(2, 6, u64::MAX).is_none());
        c.append(&[e(6, 1, 2000)]);
        assert!(c.is_empty(), "an entry above the byte bound is not cached");
    }

    #[test]
    fn replaces_suffix_and_drops_prefix() {
        let mut c = EntryCache::new(10, 10_000);
        c.append(&[e(1, 1, 1), e(2, 1, 1), e(3, 1, 1)]);
        c.append(&[e(2, 2, 1)]);
        let got = c.get(1, 3, u64::MAX).unwrap();
        assert_eq!(got, vec![e(1, 1, 1), e(2, 2, 1)]);
        c.drop_through(1);
        assert_eq!(c.first_index(), Some(2));
        c.append(&[e(7, 3, 1)]);
        assert_eq!(c.first_index(), Some(7), "a gap restarts the cache");
        assert_eq!(c.size_bytes(), e(7, 3, 1).size_bytes());
    }
}
