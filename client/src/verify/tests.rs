//! `gateway verify` unit tests.

use super::receipt::decode_receipt_text;
use base64::Engine as _;

#[test]
fn receipt_text_forms() {
    let raw = vec![0x84, 1, 2, 3, 0xff];
    assert_eq!(decode_receipt_text(&raw).unwrap(), raw);
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&raw);
    assert_eq!(decode_receipt_text(b64.as_bytes()).unwrap(), raw);
    assert_eq!(
        decode_receipt_text(format!("{b64}\n").as_bytes()).unwrap(),
        raw
    );
    assert_eq!(
        decode_receipt_text(format!("Receipt: {b64}\r\n").as_bytes()).unwrap(),
        raw
    );
    let dump = format!("HTTP/1.1 200 OK\r\nreceipt-id: 00ff\r\nReceipt: {b64}\r\n\r\n");
    assert_eq!(decode_receipt_text(dump.as_bytes()).unwrap(), raw);
    assert!(decode_receipt_text(b"not base64 at all!").is_err());
}
