//! A route's destination may be a URL with a password or a token in it:
//! no message about the route echoes them.

use super::*;

/// A webhook route to `destination`, named or not.
fn route(destination: &str, name: Option<&str>) -> String {
    let name = name.map(|n| format!("name = \"{n}\"\n")).unwrap_or_default();
    format!(
        "[sinks.hooks]\nkind = \"webhook\"\n[[routes]]\n{name}match = \"a.*\"\nsink = \"hooks\"\n\
         destination = \"{destination}\"\n"
    )
}

#[test]
fn an_unclosed_brace_does_not_echo_the_destinations_secrets() {
    let e = errors_with(&route("https://u:s3cret@h/in?token=t0k&x={type", Some("in")));
    assert!(
        e.starts_with(
            "routes[0].destination: \"https://***@h/in?token=***&x=***\" has an unclosed { (character 35); \
             close it, or remove it"
        ),
        "{e}"
    );
    assert!(!e.contains("s3cret") && !e.contains("t0k"), "{e}");
}

/// An unknown placeholder is named where the message may show it; one in
/// the credentials or the query is counted, not shown.
#[test]
fn an_unknown_placeholder_in_a_hidden_part_is_not_shown() {
    let e = errors_with(&route("https://u:s3{cr}et@h/{tpye}?token=t0{k}", Some("in")));
    assert!(
        e.starts_with("routes[0].destination: unknown placeholder {...} (2 in the credentials, query or fragment"),
        "{e}"
    );
    assert!(e.contains(", {tpye}; use {type}, {domain}, {key}, {id}"), "{e}");
    assert!(!e.contains("s3") && !e.contains("cr}") && !e.contains("t0"), "{e}");
}

/// Two routes to one destination with credentials, neither named: the
/// second's default name collides with the first's, and that message
/// showed the name, destination and all.
#[test]
fn a_default_name_shown_in_a_collision_hides_the_destinations_secrets() {
    let destination = "https://u:s3cret@h/in?token=t0k";
    let twice = format!(
        "{}[[routes]]\nmatch = \"b.*\"\nsink = \"hooks\"\ndestination = \"{destination}\"\n",
        route(destination, None)
    );
    let e = errors_with(&twice);
    assert!(
        e.contains("routes[1].name: the default name (<sink>:<destination>) \"hooks:https://***@h/in?token=***\" is already used by routes[0]"),
        "{e}"
    );
    assert!(!e.contains("s3cret") && !e.contains("t0k"), "{e}");
    // A sink whose name starts with '(' gives a default name Ferry keeps.
    let e = errors_with(
        &route(destination, None)
            .replace("[sinks.hooks]", "[sinks.\"(hooks)\"]")
            .replace("sink = \"hooks\"", "sink = \"(hooks)\""),
    );
    assert!(
        e.contains("routes[0].name: \"(hooks):https://***@h/in?token=***\" starts with '('"),
        "{e}"
    );
    assert!(!e.contains("s3cret") && !e.contains("t0k"), "{e}");
}
