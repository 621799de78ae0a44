//! Tool-call ids: unique per response and unlikely to collide across responses.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Makes call ids: random (`call_` + 24 base-62 characters) or sequential for tests.
#[derive(Debug, Clone)]
pub enum CallIds {
    /// Random ids, seeded from the process's hash randomness.
    Random {
        /// Calls made so far (mixed into each id).
        count: u64,
    },
    /// `prefix0`, `prefix1`, ...: deterministic, for tests.
    Sequential {
        /// Text before the number.
        prefix: String,
        /// Next number.
        next: u64,
    },
}

impl Default for CallIds {
    fn default() -> Self {
        CallIds::Random { count: 0 }
    }
}

impl CallIds {
    /// The next id.
    pub fn next_id(&mut self) -> String {
        match self {
            CallIds::Sequential { prefix, next } => {
                *next += 1;
                format!("{prefix}{}", *next - 1)
            }
            CallIds::Random { count } => {
                *count += 1;
                let mut id = String::from("call_");
                for round in 0..4u64 {
                    let mut h = RandomState::new().build_hasher();
                    h.write_u64(*count);
                    h.write_u64(round);
                    let mut x = h.finish();
                    for _ in 0..6 {
                        id.push(ALPHABET[(x % 62) as usize] as char);
                        x /= 62;
                    }
                }
                id
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_are_unique_and_well_formed() {
        let mut ids = CallIds::default();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let id = ids.next_id();
            assert_eq!(id.len(), 29);
            assert!(id[5..].bytes().all(|b| b.is_ascii_alphanumeric()));
            assert!(seen.insert(id));
        }
        let mut seq = CallIds::Sequential {
            prefix: "call_".into(),
            next: 0,
        };
        assert_eq!(
            (seq.next_id(), seq.next_id()),
            ("call_0".to_string(), "call_1".to_string())
        );
    }
}
