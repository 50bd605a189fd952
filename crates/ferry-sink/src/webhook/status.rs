//! HTTP status codes, classified once so the rest of the sink branches on an
//! [`ErrorKind`] instead of on response text, and `Retry-After` parsing.

use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use ferry_core::ErrorKind;

/// How a response with this status should be handled; `None` is success.
///
/// | status | outcome |
/// | --- | --- |
/// | 2xx | published |
/// | 408 Request Timeout, 409 Conflict, 425 Too Early, 429 Too Many Requests, 5xx | transient: retried |
/// | 3xx | permanent: redirects are not followed, a moved endpoint needs a new route |
/// | any other 4xx | permanent: the receiver refused this event for good |
/// | 1xx and codes outside 100..=599 | transient: a confused receiver or proxy |
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::webhook::status_kind;
/// assert_eq!(status_kind(204), None);
/// assert_eq!(status_kind(429), Some(ErrorKind::Transient));
/// assert_eq!(status_kind(425), Some(ErrorKind::Transient));
/// assert_eq!(status_kind(409), Some(ErrorKind::Transient));
/// assert_eq!(status_kind(410), Some(ErrorKind::Permanent));
/// ```
pub fn status_kind(status: u16) -> Option<ErrorKind> {
    match status {
        200..=299 => None,
        // 425: the receiver will not risk a replay now; RFC 8470 (5.2)
        // says to retry. 409: a receiver that deduplicates on `webhook-id`
        // answers it to a resend (after our timeout) of an event it is
        // still processing; refusing it for good would kill a delivery
        // that is about to succeed, and block its key.
        408 | 409 | 425 | 429 => Some(ErrorKind::Transient),
        300..=499 => Some(ErrorKind::Permanent),
        _ => Some(ErrorKind::Transient),
    }
}

/// The delay a `Retry-After` value asks for: delay-seconds (`120`) or an
/// HTTP-date (`Wed, 21 Oct 2015 07:28:00 GMT`); a date in the past is zero.
/// `None` for anything else.
///
/// ```
/// use std::time::Duration;
/// use ferry_sink::webhook::parse_retry_after;
/// assert_eq!(parse_retry_after("120", chrono::Utc::now()), Some(Duration::from_secs(120)));
/// ```
pub fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return value.parse().ok().map(Duration::from_secs);
    }
    // An HTTP-date: IMF-fixdate (an RFC 2822 date), or one of the two
    // obsolete forms RFC 9110 (5.6.7) says a recipient must still accept.
    let at = DateTime::parse_from_rfc2822(value)
        .map(|at| at.with_timezone(&Utc))
        .or_else(|_| NaiveDateTime::parse_from_str(value, "%A, %d-%b-%y %H:%M:%S GMT").map(|at| at.and_utc()))
        .or_else(|_| NaiveDateTime::parse_from_str(value, "%a %b %e %H:%M:%S %Y").map(|at| at.and_utc()))
        .ok()?;
    Some((at - now).to_std().unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_table() {
        for ok in [200, 201, 202, 204, 299] {
            assert_eq!(status_kind(ok), None, "{ok}");
        }
        for transient in [408, 409, 425, 429, 500, 502, 503, 504, 599, 100, 600, 0] {
            assert_eq!(status_kind(transient), Some(ErrorKind::Transient), "{transient}");
        }
        for permanent in [
            300, 301, 302, 303, 307, 308, 400, 401, 403, 404, 405, 410, 413, 422, 499,
        ] {
            assert_eq!(status_kind(permanent), Some(ErrorKind::Permanent), "{permanent}");
        }
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = DateTime::parse_from_rfc3339("2015-10-21T07:27:00Z").unwrap().to_utc();
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        // RFC 850 and asctime, the obsolete forms.
        assert_eq!(
            parse_retry_after("Wednesday, 21-Oct-15 07:28:00 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            parse_retry_after("Wed Oct 21 07:28:00 2015", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(parse_retry_after("Wed Oct  7 07:28:00 2015", now), Some(Duration::ZERO));
        for bad in ["", "-5", "1.5", "soon", "99999999999999999999999"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad}");
        }
    }
}
