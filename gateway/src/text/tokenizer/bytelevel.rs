//! GPT-2's reversible byte ↔ printable-character map used by byte-level BPE vocabularies.

/// Bytes that byte-level BPE writes as themselves; every other byte moves to U+0100 and up.
fn is_printable(b: u32) -> bool {
    (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
}

/// The byte ↔ char map, both directions.
pub struct ByteLevelMap {
    to_char: [char; 256],
    /// Byte for the shifted code points U+0100..=U+0143.
    from_shifted: [u8; 68],
}

impl ByteLevelMap {
    /// Builds GPT-2's `bytes_to_unicode` table.
    pub fn new() -> Self {
        let mut to_char = ['\0'; 256];
        let mut from_shifted = [0u8; 68];
        let mut extra = 0u32;
        for b in 0..256u32 {
            let c = if is_printable(b) {
                b
            } else {
                from_shifted[extra as usize] = b as u8;
                extra += 1;
                255 + extra
            };
            to_char[b as usize] = char::from_u32(c).expect("all mapped code points are valid");
        }
        ByteLevelMap {
            to_char,
            from_shifted,
        }
    }

    /// The character standing for `b`.
    pub fn char_of(&self, b: u8) -> char {
        self.to_char[b as usize]
    }

    /// Converts a vocabulary string back to the bytes it stands for; `None` when a character is
    /// outside the map (then the token is not byte-level encoded and its UTF-8 is used as is).
    pub fn token_bytes(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| {
                let cp = c as u32;
                if cp < 256 && is_printable(cp) {
                    Some(cp as u8)
                } else if (256..256 + 68).contains(&cp) {
                    Some(self.from_shifted[(cp - 256) as usize])
                } else {
                    None
                }
            })
            .collect()
    }
}

impl Default for ByteLevelMap {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_round_trips_every_byte() {
        let m = ByteLevelMap::new();
        assert_eq!(m.char_of(b' '), 'Ġ');
        assert_eq!(m.char_of(b'\n'), 'Ċ');
        assert_eq!(m.char_of(b'a'), 'a');
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            assert!(seen.insert(m.char_of(b)));
            assert_eq!(m.token_bytes(&m.char_of(b).to_string()), Some(vec![b]));
        }
        assert_eq!(m.token_bytes("€"), None);
        assert_eq!(m.token_bytes(" "), None);
    }
}
