//! Binary values as people paste them: base64 in any of its four common
//! forms (standard or URL-safe alphabet, padded or not), whitespace ignored.

use base64::Engine as _;

/// Decodes `text` as base64 in whichever common form it is written.
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let text: String = text.split_whitespace().collect();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|e| e.decode(&text).ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_form_decodes() {
        let want = [0xfb, 0xff, 0x01];
        for text in ["+/8B", "-_8B", "+/8B\n", "AQ==", "AQ"] {
            let got = super::decode_base64(text).unwrap_or_else(|| panic!("{text:?}"));
            if text.starts_with('A') {
                assert_eq!(got, [1]);
            } else {
                assert_eq!(got, want);
            }
        }
        assert!(super::decode_base64("not base64!").is_none());
    }
}
