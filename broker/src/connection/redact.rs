//! Keeps passwords out of every text that may reach a log.

use crate::config::Endpoint;
use std::sync::Arc;

/// Replaces a broker's passwords in any text that may reach a log: error strings come from
/// lapin and the OS, and we never want to rely on them leaving the URI out.
#[derive(Clone, Debug, Default)]
pub(crate) struct Redactor(Arc<Vec<String>>);

impl Redactor {
    pub(crate) fn new(hosts: &[Endpoint]) -> Self {
        let mut secrets: Vec<String> = Vec::new();
        for h in hosts {
            if h.password.is_empty() {
                continue;
            }
            secrets.push(h.password.clone());
            let encoded = percent_encode(&h.password);
            if encoded != h.password {
                secrets.push(encoded);
            }
        }
        // Longest first, so a password containing another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Redactor(Arc::new(secrets))
    }

    /// Masks what stands in a URI's password field (`scheme://user:PASSWORD@host`), by position.
    /// Safe on any text, also text a user wrote (an exchange name in a broker's error): it never
    /// looks for the password itself, so such text cannot be used to test a guess.
    pub(crate) fn clean(&self, text: &str) -> String {
        mask_uri_passwords(text)
    }

    /// For the error texts of the connection step (opening a connection or a channel, the
    /// connection's own errors), which no user writes: also every known password, and its
    /// percent-encoded form, wherever it stands. Apply it to the error alone, before the
    /// `user@host` it is reported with is put in front (a password may equal the user name).
    pub(crate) fn clean_secrets(&self, text: &str) -> String {
        let mut out = mask_uri_passwords(text);
        for s in self.0.iter() {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), "********");
            }
        }
        out
    }
}

/// `scheme://user:secret@host…` becomes `scheme://user:********@host…`, for every URI in `text`.
fn mask_uri_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority
            .rfind('@')
            .and_then(|at| authority[..at].find(':').map(|colon| (colon, at)))
        {
            Some((colon, at)) => {
                out.push_str(&authority[..=colon]);
                out.push_str("********");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::fixtures::endpoint;

    fn ep(password: &str) -> Endpoint {
        endpoint("h", password)
    }

    #[test]
    fn connection_errors_lose_passwords_and_their_encoding() {
        let r = Redactor::new(&[ep("s3cr/t p@ss"), ep(""), ep("other")]);
        let text = "auth failed for amqp://u:s3cr%2Ft%20p%40ss@h and s3cr/t p@ss, other";
        let clean = r.clean_secrets(text);
        assert!(!clean.contains("s3cr"), "{clean}");
        assert!(!clean.contains("other"), "{clean}");
        assert!(clean.contains("amqp://u:********@h"), "{clean}");
        // An empty password redacts nothing.
        assert_eq!(Redactor::new(&[ep("")]).clean_secrets("abc"), "abc");
    }

    #[test]
    fn other_text_is_masked_by_position_only() {
        // A password cannot be confirmed by naming an exchange after a guess...
        let r = Redactor::new(&[ep("guest")]);
        let text = "404 NOT_FOUND - no exchange 'guest' in vhost '/'";
        assert_eq!(r.clean(text), text);
        // ...and a user name equal to the password stays readable...
        assert_eq!(r.clean("guest@127.0.0.1:5672/"), "guest@127.0.0.1:5672/");
        // ...while a URI's password field is always masked.
        assert_eq!(
            r.clean("see amqps://app:hunter2@rabbit:5671/%2F and amqp://h/x"),
            "see amqps://app:********@rabbit:5671/%2F and amqp://h/x"
        );
    }
}
