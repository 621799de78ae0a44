//! The HPACK Huffman code of RFC 7541 (Appendix B). The code is canonical: ordering the byte
//! values by (code length, value) and counting up assigns every code, so only the lengths are
//! tabulated here and the codes are derived from them.

use std::sync::OnceLock;

/// Code length in bits of each byte value, 16 values per line (RFC 7541, Appendix B).
const CODE_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
     6, 10, 10, 12, 13,  6,  8, 11, 10, 10,  8, 11,  8,  6,  6,  6,
     5,  5,  5,  6,  6,  6,  6,  6,  6,  6,  7,  8, 15,  6, 12, 10,
    13,  6,  7,  7,  7,  7,  7,  7,  7,  7,  7,  7,  7,  7,  7,  7,
     7,  7,  7,  7,  7,  7,  7,  7,  8,  7,  8, 13, 19, 13, 14,  6,
    15,  5,  6,  5,  6,  5,  6,  6,  6,  5,  7,  7,  6,  6,  6,  5,
     6,  7,  6,  5,  5,  6,  7,  7,  7,  7,  7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
];

/// `(bit length, code)` of each byte value.
pub fn codes() -> &'static [(u8, u32); 256] {
    static TABLE: OnceLock<[(u8, u32); 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut order: Vec<usize> = (0..256).collect();
        order.sort_by_key(|&b| (CODE_LENGTHS[b], b));
        let mut table = [(0u8, 0u32); 256];
        let (mut code, mut prev_len) = (0u32, CODE_LENGTHS[order[0]]);
        for (k, &b) in order.iter().enumerate() {
            let len = CODE_LENGTHS[b];
            if k > 0 {
                code = (code + 1) << (len - prev_len);
            }
            prev_len = len;
            table[b] = (len, code);
        }
        table
    })
}

#[cfg(test)]
mod tests {
    use super::codes;

    #[test]
    fn canonical_codes_match_rfc_examples() {
        // RFC 7541 Appendix B rows: '0' = 00000 (5), 'a' = 00011 (5), ' ' = 010100 (6),
        // 'A' = 100001 (6), '\0' = 1111111111000 (13), 255 = 11111111111111111111101110 (26).
        let t = codes();
        assert_eq!(t[b'0' as usize], (5, 0x0));
        assert_eq!(t[b'a' as usize], (5, 0x3));
        assert_eq!(t[b' ' as usize], (6, 0x14));
        assert_eq!(t[b'A' as usize], (6, 0x21));
        assert_eq!(t[0], (13, 0x1ff8));
        assert_eq!(t[255], (26, 0x3ffffee));
    }
}
