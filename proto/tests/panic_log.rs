//! The binaries' panic hook ([`proto::io::logging::install_panic_hook`]):
//! a panic is logged as where it happened, and its message, which can quote
//! the text it failed on (a prompt, in a tokenizer), is not.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A log writer that keeps what it is given.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_panic_is_logged_without_the_text_it_quotes() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .finish();
    proto::io::logging::install_panic_hook();
    tracing::subscriber::with_default(subscriber, || {
        // Slicing inside a character: the standard library's message
        // quotes the string.
        let text = std::hint::black_box(String::from("the patient's diagnosis: é"));
        let cut = std::panic::catch_unwind(|| text[..text.len() - 1].len());
        assert!(cut.is_err());
    });
    let _ = std::panic::take_hook();
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("panic (its message is not logged"), "{log}");
    assert!(log.contains("panic_log.rs"), "{log}");
    assert!(!log.contains("diagnosis"), "{log}");
}
