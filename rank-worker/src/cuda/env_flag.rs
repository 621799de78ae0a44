//! Process-wide on/off switches of the CUDA backend: read from an environment variable on first
//! use, and overridable without touching the environment (benchmark A/B runs, tests).

use std::sync::atomic::{AtomicU8, Ordering};

/// Not decided yet: read the environment on the next [`EnvFlag::get`].
const UNREAD: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// A boolean setting: `var` = `1` turns it on, `0` off; unset or any other value gives
/// `default`.
pub struct EnvFlag {
    var: &'static str,
    default: bool,
    state: AtomicU8,
}

impl EnvFlag {
    /// A switch read from `var`, `default` when unset.
    pub const fn new(var: &'static str, default: bool) -> Self {
        Self { var, default, state: AtomicU8::new(UNREAD) }
    }

    /// The current value: the override if one is set, else the environment's (read once).
    pub fn get(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            ON => true,
            OFF => false,
            _ => {
                let on = Self::parse(std::env::var(self.var).ok().as_deref(), self.default);
                self.state.store(if on { ON } else { OFF }, Ordering::Relaxed);
                on
            }
        }
    }

    /// Overrides the value for every later [`EnvFlag::get`]; `None` = back to the environment.
    pub fn set(&self, on: Option<bool>) {
        let s = match on {
            None => UNREAD,
            Some(true) => ON,
            Some(false) => OFF,
        };
        self.state.store(s, Ordering::Relaxed);
    }

    fn parse(v: Option<&str>, default: bool) -> bool {
        match v {
            Some("1") => true,
            Some("0") => false,
            _ => default,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EnvFlag;

    #[test]
    fn values_overrides_and_defaults() {
        assert!(EnvFlag::parse(Some("1"), false));
        assert!(!EnvFlag::parse(Some("0"), true));
        assert!(EnvFlag::parse(None, true) && !EnvFlag::parse(None, false));
        assert!(EnvFlag::parse(Some("yes"), true) && !EnvFlag::parse(Some("yes"), false));
        // A variable no test sets: the default, then overrides, then the default again.
        static F: EnvFlag = EnvFlag::new("MINIMAX_TEST_ENV_FLAG_NEVER_SET", true);
        assert!(F.get());
        F.set(Some(false));
        assert!(!F.get());
        F.set(Some(true));
        assert!(F.get());
        F.set(None);
        assert!(F.get());
    }
}
