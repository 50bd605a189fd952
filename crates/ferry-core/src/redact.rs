//! URLs fit for logs, messages, metrics and reports.
//!
//! Every URL Ferry shows (a database's, a broker's, a webhook endpoint's)
//! goes through [`url`] first. It works on the text, not a parsed URL, so a
//! URL too broken to parse is hidden as well as a good one.

/// Query parameters whose values configure a connection and carry no
/// secret; every other parameter's value is hidden. A password or key may
/// be passed in the query (`?password=`, `?token=`, `?sig=`), and a
/// webhook's query is the receiver's own, so unknown means secret.
const PLAIN_PARAMETERS: &[&str] = &[
    "application_name",
    "auth_mechanism",
    "channel_max",
    "connect_timeout",
    "connection_timeout",
    "dbname",
    "frame_max",
    "heartbeat",
    "host",
    "hostaddr",
    "mode",
    "options",
    "port",
    "ssl-cert",
    "ssl-key",
    "ssl-mode",
    "ssl-root-cert",
    "sslcert",
    "sslkey",
    "sslmode",
    "sslrootcert",
    "statement-cache-capacity",
    "target_session_attrs",
    "user",
];

/// Schemes whose user info is hidden whole, user part and all.
const HTTP_SCHEMES: &[&str] = &["http", "https"];

/// Schemes whose user part, standing alone, is a user name. Elsewhere it is
/// a credential: NATS reads `nats://TOKEN@host` as a token, and an HTTP API
/// key is often sent as the user part of Basic authentication.
const USER_NAME_SCHEMES: &[&str] = &[
    "amqp",
    "amqps",
    "mysql",
    "postgres",
    "postgresql",
    "redis",
    "rediss",
    "sqlite",
];

/// Schemes whose path names a database, a virtual host or a file, never a
/// secret: their path is shown whole. Elsewhere a webhook's path often
/// holds its token (Slack's `/services/T…/B…/TOKEN`, Discord's
/// `/api/webhooks/ID/TOKEN`), so a segment that looks like one is hidden.
const PLAIN_PATH_SCHEMES: &[&str] = &[
    "amqp",
    "amqps",
    "mysql",
    "postgres",
    "postgresql",
    "redis",
    "rediss",
    "sqlite",
];

/// The shortest piece of a path segment taken for a token (see [`url`]).
const TOKEN_SEGMENT_LEN: usize = 16;

/// `url` with every credential it may carry replaced by `***`: the
/// password of its user info, a user part that may be a credential (all of
/// an HTTP URL's; elsewhere see [`USER_NAME_SCHEMES`]), every path segment
/// that looks like a token (outside [`PLAIN_PATH_SCHEMES`]), the value of
/// every query parameter not known to be plain, and a fragment. Text
/// without `://` is returned as it is.
///
/// A path segment looks like a token when it is a UUID, or when a piece of
/// it between separators (`-`, `_`, `.`, `~`) is at least 16 characters
/// long and holds digits and letters (a Slack, Discord or Teams token, a
/// long hex or base64 string), or mixes cases in no word's way (four
/// changes from lower to upper case or more), or is at least 20 long with
/// no lower-case letter (Slack's documented example is all capitals). A
/// word like `notifications-webhook-receiver`, `ProcessOrderEvents` or
/// `orders-events-2024`, a long number (an id, not a key) and a short
/// segment (`T00000000`, `v2`, `%2f`, `0`) are shown, and so is the path's
/// shape: such a path names a route by default without being refused.
/// The segment is judged percent-decoded (`%2F` is one character,
/// a `/`, and `%41` is an `A`), so an escaped name is not hidden for its
/// escapes' hex digits, and an escaped token is hidden all the same. A
/// template placeholder (`{type}`, `{tenant}`: lower-case letters and `_`
/// in braces) counts for nothing, so a segment of placeholders is shown.
///
/// The user info ends at the last `@`, wherever it is: a password may hold
/// `/`, `?`, `#` or `@` unescaped. When that `@` was in fact in the query
/// (`?reply_to=ops@example.com&sig=…`), what follows it is no host: the
/// host is shown only when every character of it may be in one (letters,
/// digits, `.`, `-`, `_`, `:`, `[`, `]`, `%`, and placeholders), and
/// otherwise all that follows the `@` is `***`.
///
/// ```
/// use ferry_core::redact;
/// assert_eq!(redact::url("postgres://app:s3cret@db/app?sslmode=require"), "postgres://app:***@db/app?sslmode=require");
/// assert_eq!(redact::url("https://hooks.example/in?token=s3cret"), "https://hooks.example/in?token=***");
/// assert_eq!(redact::url("nats://s3cret@nats:4222"), "nats://***@nats:4222");
/// assert_eq!(redact::url("https://user:pw@hooks.example/in"), "https://***@hooks.example/in");
/// assert_eq!(
///     redact::url("https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX"),
///     "https://hooks.slack.com/services/T00000000/B00000000/***"
/// );
/// assert_eq!(redact::url("https://h.example/in?to=ops@example.com&sig=s3cret"), "https://***@***");
/// ```
pub fn url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let lower_scheme = scheme.to_ascii_lowercase();
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    out.push_str("://");
    // The user info ends at the last `@`: a password may hold `/`, `?`, `#`
    // or `@` unescaped, and hiding too much is the safe side.
    let rest = match rest.rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            match userinfo.split_once(':') {
                // An HTTP user part is as likely an API key as a name.
                _ if HTTP_SCHEMES.contains(&lower_scheme.as_str()) => out.push_str("***"),
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None if USER_NAME_SCHEMES.contains(&lower_scheme.as_str()) => out.push_str(userinfo),
                None => out.push_str("***"),
            }
            out.push('@');
            let rest = &rest[at + 1..];
            let host = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
            // The `@` may have been in the path, the query or the fragment,
            // and what follows it a query value, whether or not it could be
            // a host.
            if !userinfo_before_host(userinfo) || !could_be_host(host) {
                out.push_str("***");
                return out;
            }
            rest
        }
        None => rest,
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, rest) = rest.split_at(authority_end);
    out.push_str(host);
    let (before_fragment, fragment) = match rest.split_once('#') {
        Some((before, _)) => (before, true),
        None => (rest, false),
    };
    let (path, query) = match before_fragment.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (before_fragment, None),
    };
    if PLAIN_PATH_SCHEMES.contains(&lower_scheme.as_str()) {
        out.push_str(path);
    } else {
        for (i, segment) in path.split('/').enumerate() {
            if i > 0 {
                out.push('/');
            }
            out.push_str(if looks_like_token(segment) { "***" } else { segment });
        }
    }
    if let Some(query) = query {
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match pair.split_once('=') {
                Some((name, value)) if !value.is_empty() && !PLAIN_PARAMETERS.contains(&name) => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                // A bare `?TOKEN`.
                None if !pair.is_empty() => out.push_str("***"),
                _ => out.push_str(pair),
            }
        }
    }
    if fragment {
        out.push_str("#***");
    }
    out
}

/// `text` with its template placeholders (`{type}`, `{tenant}`: lower-case
/// letters and `_` in braces) taken out. What they hold could never make a
/// segment look like a token, and could not be a host's secret.
fn without_placeholders(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('{') {
        return text.into();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) if close > 0 && after[..close].bytes().all(|b| b.is_ascii_lowercase() || b == b'_') => {
                rest = &after[close + 1..];
            }
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.into()
}

/// Whether the text before a URL's last `@` can be user info: either no
/// `/`, `?` or `#` in it, or a password holding them (after a `:` that
/// does not start a port). Otherwise that `@` was in the path, the query or
/// the fragment (`h/in?to=ops`, `h:8080/in?to=ops`).
fn userinfo_before_host(userinfo: &str) -> bool {
    let Some(syntax) = userinfo.find(['/', '?', '#']) else {
        return true;
    };
    match userinfo[..syntax].split_once(':') {
        Some((_, port)) => !port.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// Whether every character of `host` may be in a host (a name, an IPv4 or
/// a bracketed IPv6 address, a port, a percent escape), placeholders aside.
fn could_be_host(host: &str) -> bool {
    without_placeholders(host)
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:[]%".contains(&b))
}

/// Whether a path segment looks like a token: see [`url`].
fn looks_like_token(segment: &str) -> bool {
    let segment = without_placeholders(segment);
    let bytes = segment.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                i += 3;
            }
            (b, ..) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    is_uuid(&decoded) || decoded.split(|b| b"-_.~".contains(b)).any(token_piece)
}

/// A piece of a path segment between separators, percent-decoded, that
/// looks like a secret: 16 characters or more holding digits and letters
/// (hex, base64, a random key), or mixed case in no word's way (four
/// changes from lower to upper case or more, which `ProcessOrderEvents`
/// has not), or 20 or more with no lower-case letter.
fn token_piece(piece: &[u8]) -> bool {
    // A character is counted once, at its first byte.
    let len = piece.iter().filter(|&&b| b & 0xC0 != 0x80).count();
    if len < TOKEN_SEGMENT_LEN {
        return false;
    }
    let digit = piece.iter().any(u8::is_ascii_digit);
    let letter = piece.iter().any(u8::is_ascii_alphabetic);
    let lower = piece.iter().any(u8::is_ascii_lowercase);
    let humps = piece
        .windows(2)
        .filter(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase())
        .count();
    (digit && letter) || humps >= 4 || (len >= 20 && letter && !lower)
}

/// Whether `segment` is a UUID (8-4-4-4-12 hex digits).
fn is_uuid(segment: &[u8]) -> bool {
    segment.len() == 36
        && segment.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// Whether [`url`] hides anything of `text`: it carries credentials, a
/// query value or a path segment that may be one.
pub fn carries_secrets(text: &str) -> bool {
    url(text) != text
}

/// Client properties (librdkafka's `extra`) fit to show: the value of one
/// whose name hints at a secret (a SASL password, key material, a JAAS
/// config) is `***`.
pub fn properties<'a>(
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> std::collections::BTreeMap<&'a str, &'a str> {
    properties
        .into_iter()
        .map(|(name, value)| {
            let lower = name.to_ascii_lowercase();
            let secret = ["password", "secret", "token", "key", "jaas"]
                .iter()
                .any(|s| lower.contains(s));
            (name.as_str(), if secret { "***" } else { value.as_str() })
        })
        .collect()
}

/// Header names with every value shown as `***`: a header is as often a
/// credential (`Authorization`) as not.
pub fn header_values<'a>(names: impl IntoIterator<Item = &'a String>) -> std::collections::BTreeMap<&'a str, &'a str> {
    names.into_iter().map(|name| (name.as_str(), "***")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_looking_properties_and_every_header_value_are_hidden() {
        let extra: std::collections::BTreeMap<String, String> = [
            ("sasl.password", "pw-1"),
            ("sasl.jaas.config", "pw-2"),
            ("ssl.key.pem", "pw-3"),
            ("linger.ms", "5"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
        let shown = properties(&extra);
        assert_eq!(shown["linger.ms"], "5");
        assert!(shown.values().filter(|v| **v == "***").count() == 3, "{shown:?}");
        let names = ["Authorization".to_owned()];
        assert_eq!(header_values(&names)["Authorization"], "***");
    }

    #[test]
    fn passwords_are_hidden_and_user_names_kept() {
        assert_eq!(url("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(
            url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(url("amqps://u:p@ss@host/vh"), "amqps://u:***@host/vh");
        assert_eq!(url("redis://:pw@127.0.0.1:6379/0"), "redis://:***@127.0.0.1:6379/0");
        assert_eq!(url("amqp://host:5672"), "amqp://host:5672");
    }

    #[test]
    fn a_user_part_that_is_a_credential_is_hidden() {
        assert_eq!(url("nats://s3cret@host:4222"), "nats://***@host:4222");
        assert_eq!(url("NATS://s3cret@host:4222"), "NATS://***@host:4222");
        assert_eq!(url("https://sk_live_1@api.example/in"), "https://***@api.example/in");
        assert_eq!(url("https://sk_live_1:@api.example/in"), "https://***@api.example/in");
        assert_eq!(
            url("https://ferry:s3cret@hooks.example/in"),
            "https://***@hooks.example/in"
        );
        assert_eq!(url("nats://u:p@127.0.0.1:4222"), "nats://u:***@127.0.0.1:4222");
    }

    #[test]
    fn a_password_with_url_syntax_in_it_is_hidden_whole() {
        assert_eq!(url("postgres://u:p#ss@h/db"), "postgres://u:***@h/db");
        assert_eq!(url("postgres://u:a/b?c@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(url("amqp://u:p@ss@host/vh"), "amqp://u:***@host/vh");
    }

    #[test]
    fn query_values_are_hidden_unless_known_to_be_plain() {
        assert_eq!(
            url("postgres://ferry@db/app?password=s3cret&sslmode=require"),
            "postgres://ferry@db/app?password=***&sslmode=require"
        );
        assert_eq!(
            url("https://hooks.example/in?token=s3cret&code=x"),
            "https://hooks.example/in?token=***&code=***"
        );
        assert_eq!(
            url("https://h.example/a?T0K3N&empty="),
            "https://h.example/a?***&empty="
        );
        assert_eq!(url("https://h.example/a#s3cret"), "https://h.example/a#***");
        assert_eq!(url("https://h.example/a?k=v#f"), "https://h.example/a?k=***#***");
    }

    #[test]
    fn a_url_too_broken_to_parse_is_hidden_all_the_same() {
        assert_eq!(
            url("https://ferry:s3cret@hooks.example:99999/in"),
            "https://***@hooks.example:99999/in"
        );
        // A space is in no host: all that follows the user info is hidden.
        assert_eq!(url("nats://u:p@{key}.nats example/in?t=1"), "nats://u:***@***");
        assert_eq!(url("nats://u:p@{key}.nats/in?t=1"), "nats://u:***@{key}.nats/in?t=***");
    }

    const SLACK: &str = "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX";
    const DISCORD: &str = "https://discord.com/api/webhooks/123456789012345678/\
                           aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789-_aBcDeFgHiJkLmNoPqRsTuVwXyZ012345";

    #[test]
    fn a_token_in_the_path_is_hidden_and_the_paths_shape_kept() {
        assert_eq!(url(SLACK), "https://hooks.slack.com/services/T00000000/B00000000/***");
        assert!(carries_secrets(SLACK));
        assert_eq!(url(DISCORD), "https://discord.com/api/webhooks/123456789012345678/***");
        assert_eq!(
            url("https://h.example/hooks/0123456789abcdef0123456789abcdef/in"),
            "https://h.example/hooks/***/in"
        );
        assert_eq!(
            url("https://h.example/hooks/9f1c2a3b-4d5e-4f60-8a7b-1c2d3e4f5a6b?x=1"),
            "https://h.example/hooks/***?x=***"
        );
        // Base64, escaped or not: decoded, it holds both cases.
        assert_eq!(
            url("https://h.example/k/dGhpc2lzYXNlY3JldHRva2Vu%3D"),
            "https://h.example/k/***"
        );
        assert_eq!(
            url("https://h.example/k/%41b%43d%45f%47h%49jKlMnOpQ"),
            "https://h.example/k/***"
        );
        assert_eq!(
            url("http://u:p@h.example/in/aBcDeFgHiJkLmNoP"),
            "http://***@h.example/in/***"
        );
        assert_eq!(url("nats://h:4222/k3yABCDEFGHijklm"), "nats://h:4222/***");
        // A token whose base64 holds a separator is still a token.
        assert_eq!(
            url("https://h.example/k/ab-0123456789abcdefXY"),
            "https://h.example/k/***"
        );
    }

    #[test]
    fn a_path_that_holds_no_token_is_shown() {
        for plain in [
            "https://h.example/notifications-webhook-receiver",
            "https://h.example/api/ProcessOrderEvents",
            "https://h.example/hooks/orders-events-2024",
            "https://h.example/webhooks/OrderCreatedHandler",
            "https://discord.com/api/webhooks/123456789012345678",
            "https://h.example/api/v2/in/",
            "https://h.example/T00000000/B00000000/0123456789abcde",
            "https://h.example/caf%C3%A9-orders-receiver",
            "https://h.example/in/{tenant}/{type}-{domain}-events/{key}{id}",
            "https://{domain}.h.example/{type}",
            "amqp://guest@127.0.0.1:5672/%2f",
            "redis://127.0.0.1:6379/0",
            "postgres://ferry@db/ferry_production_2024",
            "sqlite:///var/lib/ferry/Outbox-2024-01-01.db",
            "https://h.example",
            "https://h.example/",
        ] {
            assert_eq!(url(plain), plain);
        }
        // A placeholder counts for nothing, the rest of its segment does.
        assert_eq!(
            url("https://h.example/{type}/ABCDEFGHijklmnop0{key}"),
            "https://h.example/{type}/***"
        );
    }

    #[test]
    fn an_at_in_the_query_shows_no_query_value_as_a_host() {
        assert_eq!(
            url("https://h/in?reply_to=ops@example.com&sig=SECRET"),
            "https://***@***"
        );
        assert_eq!(
            url("https://h/in?sig=SECRET&reply_to=ops@example.com"),
            "https://***@***"
        );
        assert_eq!(
            url("https://h/in?reply_to=ops@example.com/x?sig=SECRET"),
            "https://***@***"
        );
        assert_eq!(url("https://h/in#to=ops@example.com&SECRET"), "https://***@***");
        assert_eq!(url("postgres://u:p@[::1]:5432/db"), "postgres://u:***@[::1]:5432/db");
        assert_eq!(
            url("postgres://u:p@h%2Dx_y.example:5432/db"),
            "postgres://u:***@h%2Dx_y.example:5432/db"
        );
        assert!(!url("https://h/in?reply_to=ops@example.com&sig=SECRET").contains("SECRET"));
        // What follows an `@` in the query is never shown, host-like or not.
        for leaky in [
            "https://h/hooks?api_key=abc@SECRETVALUE123",
            "https://h/hooks?to=ops@example.com:SECRETVALUE123",
            "https://h:8080/hooks?to=ops@SECRETVALUE123",
        ] {
            assert!(!url(leaky).contains("SECRETVALUE123"), "{leaky}: {}", url(leaky));
        }
    }

    #[test]
    fn text_that_is_no_url_is_kept() {
        assert_eq!(url("not a url"), "not a url");
        assert_eq!(url("127.0.0.1:4222"), "127.0.0.1:4222");
        assert_eq!(url("orders"), "orders");
        assert!(!carries_secrets("http://h.example/a"));
        assert!(carries_secrets("http://h.example/a?token=1"));
    }
}
