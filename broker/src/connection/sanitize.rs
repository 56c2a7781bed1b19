//! Makes the short strings of incoming deliveries valid UTF-8 before lapin reads them. AMQP short
//! strings (a delivery's exchange and routing key, its properties, its header names) may hold
//! any bytes, but lapin's parser refuses a frame whose short string is not UTF-8 and closes the
//! whole connection: one such message, redelivered forever, stopped its subscription. Each byte
//! of an invalid sequence becomes NUL, which keeps every length and frame size as it was (the
//! subscription worker shows NUL in names and properties as U+FFFD). Nothing else changes: body
//! frames, long strings and frames of other methods pass as they came; a frame that does not
//! parse as expected passes unchanged (lapin then reports it as before).

/// End of every AMQP frame.
const FRAME_END: u8 = 0xCE;
const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const CLASS_BASIC: u16 = 60;
const BASIC_RETURN: u16 = 50;
const BASIC_DELIVER: u16 = 60;
const BASIC_GET_OK: u16 = 71;
/// Frames larger than this are passed on without being held whole (no broker negotiates a
/// frame size near it; RabbitMQ's default is 128 KiB).
const MAX_HELD_FRAME: usize = 64 << 20;

/// Splits the byte stream from the broker into frames and sanitizes each complete one.
#[derive(Default)]
pub(crate) struct Scanner {
    held: Vec<u8>,
    /// Bytes still to pass unchanged (a protocol header, or an oversized frame's rest).
    passing: usize,
    /// Short-string bytes replaced so far.
    pub(crate) replaced: u64,
}

impl Scanner {
    /// Takes `data` from the broker; returns the bytes ready for lapin.
    pub(crate) fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.held.extend_from_slice(data);
        let mut out = Vec::with_capacity(self.held.len());
        let mut at = 0;
        loop {
            let rest = &self.held[at..];
            if self.passing > 0 {
                let n = self.passing.min(rest.len());
                out.extend_from_slice(&rest[..n]);
                self.passing -= n;
                at += n;
                if self.passing > 0 {
                    break;
                }
                continue;
            }
            // A protocol header (the broker's answer to a version it does not speak).
            if rest.starts_with(b"AMQP") {
                self.passing = 8;
                continue;
            }
            if rest.len() < 7 {
                break;
            }
            let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
            let whole = size.saturating_add(8);
            if whole > MAX_HELD_FRAME {
                self.passing = whole;
                continue;
            }
            if rest.len() < whole {
                break;
            }
            // Copied once, into what lapin gets, and sanitized there.
            let start = out.len();
            out.extend_from_slice(&rest[..whole]);
            self.replaced += sanitize_frame(&mut out[start..]) as u64;
            at += whole;
        }
        self.held.drain(..at);
        out
    }
}

/// Sanitizes one complete frame in place; returns how many bytes it replaced.
pub(crate) fn sanitize_frame(frame: &mut [u8]) -> usize {
    if frame.len() < 8 || frame[frame.len() - 1] != FRAME_END {
        return 0;
    }
    let end = frame.len() - 1;
    // Body frames (most of the bytes) and heartbeats carry no short string: not copied.
    let read: fn(&mut [u8]) -> Option<usize> = match frame[0] {
        FRAME_METHOD => method,
        FRAME_HEADER => header,
        _ => return 0,
    };
    // Read on a copy: a frame that does not parse to its end is passed on as it came.
    let mut copy = frame[7..end].to_vec();
    let done = read(&mut copy);
    match done {
        Some(n) if n > 0 => {
            frame[7..end].copy_from_slice(&copy);
            n
        }
        _ => 0,
    }
}

/// A cursor over a frame's payload that fixes short strings as it reads them.
struct Cursor<'a> {
    buf: &'a mut [u8],
    at: usize,
    replaced: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<std::ops::Range<usize>> {
        let end = self.at.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        let r = self.at..end;
        self.at = end;
        Some(r)
    }

    fn u8(&mut self) -> Option<u8> {
        let r = self.take(1)?;
        Some(self.buf[r.start])
    }

    fn u16(&mut self) -> Option<u16> {
        let r = self.take(2)?;
        Some(u16::from_be_bytes([
            self.buf[r.start],
            self.buf[r.start + 1],
        ]))
    }

    fn u32(&mut self) -> Option<usize> {
        let r = self.take(4)?;
        let b = &self.buf[r];
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }

    fn short_string(&mut self) -> Option<()> {
        let n = usize::from(self.u8()?);
        let r = self.take(n)?;
        self.replaced += make_utf8(&mut self.buf[r]);
        Some(())
    }

    fn table(&mut self) -> Option<()> {
        let n = self.u32()?;
        let end = self.at.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        while self.at < end {
            self.short_string()?;
            self.value()?;
        }
        (self.at == end).then_some(())
    }

    fn array(&mut self) -> Option<()> {
        let n = self.u32()?;
        let end = self.at.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        while self.at < end {
            self.value()?;
        }
        (self.at == end).then_some(())
    }

    /// One field value, by its type letter (as lapin reads them: 's' is a short int).
    fn value(&mut self) -> Option<()> {
        match self.u8()? {
            b't' | b'b' | b'B' => self.skip(1),
            b's' | b'U' | b'u' => self.skip(2),
            b'I' | b'i' | b'f' => self.skip(4),
            b'L' | b'l' | b'd' | b'T' => self.skip(8),
            b'D' => self.skip(5),
            b'S' | b'x' => {
                let n = self.u32()?;
                self.skip(n)
            }
            b'A' => self.array(),
            b'F' => self.table(),
            b'V' => Some(()),
            _ => None,
        }
    }
}

/// The basic methods that carry a message's names: deliver, get-ok, return.
fn method(payload: &mut [u8]) -> Option<usize> {
    let mut c = Cursor {
        buf: payload,
        at: 0,
        replaced: 0,
    };
    let (class, method) = (c.u16()?, c.u16()?);
    if class != CLASS_BASIC {
        return Some(0);
    }
    match method {
        BASIC_DELIVER => {
            c.short_string()?; // consumer tag
            c.skip(9)?; // delivery tag, redelivered
            c.short_string()?; // exchange
            c.short_string()?; // routing key
        }
        BASIC_GET_OK => {
            c.skip(9)?;
            c.short_string()?;
            c.short_string()?;
        }
        BASIC_RETURN => {
            c.skip(2)?; // reply code
            c.short_string()?; // reply text
            c.short_string()?;
            c.short_string()?;
        }
        _ => {}
    }
    Some(c.replaced)
}

/// A content header of the basic class: its properties, in the order of their flag bits.
fn header(payload: &mut [u8]) -> Option<usize> {
    let mut c = Cursor {
        buf: payload,
        at: 0,
        replaced: 0,
    };
    if c.u16()? != CLASS_BASIC {
        return Some(0);
    }
    c.skip(10)?; // weight, body size
    let flags = c.u16()?;
    if flags & 1 != 0 {
        // A continuation: the basic class has no 15th property.
        return None;
    }
    for bit in (2..=15).rev() {
        if flags & (1 << bit) == 0 {
            continue;
        }
        match bit {
            13 => c.table()?,       // headers
            12 | 11 => c.skip(1)?,  // delivery mode, priority
            6 => c.skip(8)?,        // timestamp
            _ => c.short_string()?, // the short-string properties
        }
    }
    Some(c.replaced)
}

/// Replaces each byte of every invalid UTF-8 sequence in `s` with NUL; returns how many.
fn make_utf8(s: &mut [u8]) -> usize {
    let mut replaced = 0;
    let mut at = 0;
    while at < s.len() {
        match std::str::from_utf8(&s[at..]) {
            Ok(_) => break,
            Err(e) => {
                let bad_at = at + e.valid_up_to();
                let bad_len = e.error_len().unwrap_or(s.len() - bad_at);
                for b in &mut s[bad_at..bad_at + bad_len] {
                    *b = 0;
                }
                replaced += bad_len;
                at = bad_at + bad_len;
            }
        }
    }
    replaced
}

#[cfg(test)]
mod tests {
    use super::*;

    fn short(s: &[u8]) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s);
        v
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind, 0, 1];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f.push(FRAME_END);
        f
    }

    fn deliver(routing_key: &[u8]) -> Vec<u8> {
        let mut p = vec![0, 60, 0, 60];
        p.extend(short(b"ctag"));
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 7, 0]);
        p.extend(short(b"ex"));
        p.extend(short(routing_key));
        frame(FRAME_METHOD, &p)
    }

    /// A header frame with a message_id, a correlation_id and a headers table (with a nested
    /// table).
    fn content_header(message_id: &[u8], header_name: &[u8], nested_name: &[u8]) -> Vec<u8> {
        let mut p = vec![0, 60, 0, 0];
        p.extend_from_slice(&5u64.to_be_bytes());
        let flags: u16 = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 10) | (1 << 7) | (1 << 6);
        p.extend_from_slice(&flags.to_be_bytes());
        p.extend(short(b"text/plain"));
        let mut table = short(header_name);
        table.push(b'S');
        table.extend_from_slice(&3u32.to_be_bytes());
        table.extend_from_slice(b"\xff\xfe!"); // a long string: any bytes, left alone
        table.extend(short(b"n"));
        table.push(b'F');
        let inner = [short(nested_name), vec![b'I', 0, 0, 0, 1]].concat();
        table.extend_from_slice(&(inner.len() as u32).to_be_bytes());
        table.extend_from_slice(&inner);
        p.extend_from_slice(&(table.len() as u32).to_be_bytes());
        p.extend_from_slice(&table);
        p.push(2); // delivery mode
        p.extend(short(b"corr"));
        p.extend(short(message_id));
        p.extend_from_slice(&1u64.to_be_bytes());
        frame(FRAME_HEADER, &p)
    }

    #[test]
    fn invalid_bytes_in_short_strings_become_nul_and_nothing_else_changes() {
        let mut f = content_header(b"bad\xff\xfeid", b"h\x80", b"k\xc3");
        let before = f.clone();
        assert_eq!(sanitize_frame(&mut f), 4);
        assert_eq!(f.len(), before.len());
        let changed: Vec<usize> = (0..f.len()).filter(|i| f[*i] != before[*i]).collect();
        assert_eq!(changed.len(), 4, "only the invalid bytes change");
        assert!(changed.iter().all(|i| f[*i] == 0));
        assert!(f.windows(7).any(|w| w == b"bad\0\0id"));
        assert!(
            f.windows(3).any(|w| w == b"\xff\xfe!"),
            "long strings stay as sent"
        );
        assert!(
            f.windows(2).any(|w| w == b"k\0"),
            "names in nested tables too"
        );

        let mut d = deliver(b"key\xe2\x82");
        assert_eq!(sanitize_frame(&mut d), 2);
        assert!(d.windows(5).any(|w| w == b"key\0\0"));
    }

    #[test]
    fn valid_frames_and_other_frames_pass_unchanged() {
        for f in [
            content_header("message-ü".as_bytes(), b"x-h", b"k"),
            deliver("ключ".as_bytes()),
            frame(3, b"\xff\xfe body bytes"),
            frame(FRAME_METHOD, &[0, 10, 0, 10, 0xff, 0xfe]),
            // Truncated: left for lapin to report.
            frame(FRAME_HEADER, &[0, 60, 0]),
        ] {
            let mut g = f.clone();
            assert_eq!(sanitize_frame(&mut g), 0);
            assert_eq!(g, f);
        }
    }

    #[test]
    fn the_scanner_holds_partial_frames_and_passes_whole_ones_in_order() {
        let frames = [
            deliver(b"k\xff"),
            content_header(b"id\xfe", b"h", b"k"),
            frame(3, b"body"),
        ];
        let stream = frames.concat();
        let mut s = Scanner::default();
        let mut out = Vec::new();
        for chunk in stream.chunks(5) {
            out.extend(s.push(chunk));
        }
        assert_eq!(s.replaced, 2);
        let expected: Vec<u8> = frames
            .iter()
            .flat_map(|f| {
                let mut f = f.clone();
                sanitize_frame(&mut f);
                f
            })
            .collect();
        assert_eq!(out, expected, "each frame as sanitized alone, in order");
        // A protocol header passes as it is.
        assert_eq!(s.push(b"AMQP\x00\x00\x09\x01"), b"AMQP\x00\x00\x09\x01");
    }
}
