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

/// `url` with every credential it may carry replaced by `***`: the
/// password of its user info, a user part that may be a credential (all of
/// an HTTP URL's; elsewhere see [`USER_NAME_SCHEMES`]), the value of every
/// query parameter not known to be plain, and a fragment. Text without
/// `://` is returned as it is.
///
/// ```
/// use ferry_core::redact;
/// assert_eq!(redact::url("postgres://app:s3cret@db/app?sslmode=require"), "postgres://app:***@db/app?sslmode=require");
/// assert_eq!(redact::url("https://hooks.example/in?token=s3cret"), "https://hooks.example/in?token=***");
/// assert_eq!(redact::url("nats://s3cret@nats:4222"), "nats://***@nats:4222");
/// assert_eq!(redact::url("https://user:pw@hooks.example/in"), "https://***@hooks.example/in");
/// ```
pub fn url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    out.push_str("://");
    // The user info ends at the last `@`: a password may hold `/`, `?`, `#`
    // or `@` unescaped, and hiding too much is the safe side.
    let rest = match rest.rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            let scheme = scheme.to_ascii_lowercase();
            match userinfo.split_once(':') {
                // An HTTP user part is as likely an API key as a name.
                _ if HTTP_SCHEMES.contains(&scheme.as_str()) => out.push_str("***"),
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None if USER_NAME_SCHEMES.contains(&scheme.as_str()) => out.push_str(userinfo),
                None => out.push_str("***"),
            }
            out.push('@');
            &rest[at + 1..]
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
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
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
        None => out.push_str(before_fragment),
    }
    if fragment {
        out.push_str("#***");
    }
    out
}

/// Whether [`url`] hides anything of `text`: it carries credentials or a
/// query value that may be one.
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
        assert_eq!(
            url("nats://u:p@{key}.nats example/in?t=1"),
            "nats://u:***@{key}.nats example/in?t=***"
        );
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
