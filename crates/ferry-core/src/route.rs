use crate::StoredEvent;

/// A glob over event types: `*` matches one segment, `**` any number (also
/// zero), anything else matches itself. `order.*` matches `order.created`
/// but not `order.item.created`; `order.**` matches both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    pattern: String,
    segments: Vec<String>,
    /// More than one `**`: matched by a table (see [`Glob::matches`]).
    by_table: bool,
}

impl Glob {
    pub fn new(pattern: impl Into<String>) -> Result<Self, String> {
        let pattern = pattern.into();
        if pattern.is_empty() {
            return Err("is empty; use a glob such as \"order.*\" or \"**\"".into());
        }
        let segments: Vec<String> = pattern.split('.').map(str::to_owned).collect();
        for seg in &segments {
            let ok = seg == "*"
                || seg == "**"
                || (!seg.is_empty()
                    && seg
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-'));
            if !ok {
                return Err(format!(
                    "{pattern:?} has an invalid segment {seg:?}; segments are lowercase names, \"*\" or \"**\""
                ));
            }
        }
        let by_table = segments.iter().filter(|s| *s == "**").count() > 1;
        Ok(Self {
            pattern,
            segments,
            by_table,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.pattern
    }

    pub fn matches(&self, event_type: &str) -> bool {
        let parts: Vec<&str> = event_type.split('.').collect();
        if self.by_table {
            // Trying every skip of each `**` in turn grows as the number of
            // ways to split the type among them (millions of steps for a
            // long type and a handful of `**`); this is one step per pair.
            return matches_table(&self.segments, &parts);
        }
        matches_from(&self.segments, &parts)
    }
}

/// Whether `pattern` matches `parts`, by a table of which suffixes of the
/// pattern match which suffixes of the type, filled from the ends.
fn matches_table(pattern: &[String], parts: &[&str]) -> bool {
    let width = parts.len() + 1;
    // `next[j]`: pattern[i + 1..] matches parts[j..]; `row[j]`: pattern[i..].
    let mut next = vec![false; width];
    next[parts.len()] = true;
    for seg in pattern.iter().rev() {
        let mut row = vec![false; width];
        for j in (0..width).rev() {
            row[j] = if seg == "**" {
                next[j] || (j < parts.len() && row[j + 1])
            } else {
                j < parts.len() && (seg == "*" || seg == parts[j]) && next[j + 1]
            };
        }
        next = row;
    }
    next[0]
}

fn matches_from(pattern: &[String], parts: &[&str]) -> bool {
    match pattern.split_first() {
        None => parts.is_empty(),
        Some((seg, rest)) if seg == "**" => (0..=parts.len()).any(|skip| matches_from(rest, &parts[skip..])),
        Some((seg, rest)) => match parts.split_first() {
            Some((part, tail)) if seg == "*" || seg == part => matches_from(rest, tail),
            _ => false,
        },
    }
}

/// One routing rule: events whose type matches go to `sink`, at `destination`.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Stable name; the per-route delivery state is keyed by it.
    pub name: String,
    pub matcher: Glob,
    /// Name of a configured sink.
    pub sink: String,
    /// Where the sink sends (an exchange, topic, stream, URL); may be a template.
    pub destination: String,
    /// Sink-specific sub-address (the RabbitMQ routing key); may be a template.
    pub routing_key: Option<String>,
}

/// Renders `{type}`, `{domain}`, `{key}` and `{id}` in a destination template.
///
/// ```
/// # use ferry_core::{render_template, StoredEvent, EventId};
/// # let e = StoredEvent { id: EventId::new(), seq: 1, event_type: "order.created".into(), key: Some("o-1".into()),
/// #   payload: Default::default(), content_type: "application/json".into(), headers: Default::default(), created_at: chrono::Utc::now() };
/// assert_eq!(render_template("events.{domain}.{type}", &e), "events.order.order.created");
/// ```
pub fn render_template(template: &str, event: &StoredEvent) -> String {
    render_template_with(template, event, str::to_owned)
}

/// [`render_template`], passing each placeholder's value through `escape`
/// (a URL sink percent-encodes them). One pass over the template: a value
/// that itself holds a placeholder's name (a key `"a{id}"`) is not
/// rendered again.
pub fn render_template_with(template: &str, event: &StoredEvent, escape: impl Fn(&str) -> String) -> String {
    if !template.contains('{') {
        return template.to_owned();
    }
    let domain = event.event_type.split('.').next().unwrap_or_default();
    let id = event.id.to_string();
    let values = [
        ("{type}", event.event_type.as_str()),
        ("{domain}", domain),
        ("{key}", event.key.as_deref().unwrap_or("")),
        ("{id}", id.as_str()),
    ];
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match values.iter().find(|(name, _)| rest.starts_with(name)) {
            Some((name, value)) => {
                out.push_str(&escape(value));
                rest = &rest[name.len()..];
            }
            None => {
                out.push('{');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(key: Option<&str>) -> StoredEvent {
        crate::sink::tests::ev(1, key)
    }

    #[test]
    fn templates_render_each_placeholder_once() {
        let e = event(Some("k{id}{type}"));
        assert_eq!(
            render_template("{domain}/{type}/{key}/{nope}/{", &e),
            "test/test.item.created/k{id}{type}/{nope}/{"
        );
        assert_eq!(render_template("x.{id}", &e), format!("x.{}", e.id));
        assert_eq!(render_template("plain", &e), "plain");
        assert_eq!(render_template("k={key}", &event(None)), "k=");
        let upper = render_template_with("{domain}:{key}", &e, |v| v.to_uppercase());
        assert_eq!(upper, "TEST:K{ID}{TYPE}");
    }

    #[test]
    fn globs() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("order.*").matches("order.created"));
        assert!(!g("order.*").matches("order.item.created"));
        assert!(g("order.**").matches("order.item.created"));
        assert!(g("order.**").matches("order"));
        assert!(g("**").matches("anything.at.all"));
        assert!(g("*.*.deleted").matches("billing.invoice.deleted"));
        assert!(!g("*.*.deleted").matches("billing.invoice.created"));
        assert!(g("order.created").matches("order.created"));
        assert!(!g("order.created").matches("order.created.v2"));
        assert!(Glob::new("Order.*").is_err());
        assert!(Glob::new("").is_err());
        assert!(Glob::new("a..b").is_err());
    }

    /// Several `**`: the table agrees with trying every skip, and takes one
    /// step per pair of segments where that took millions (a long type that
    /// does not match).
    #[test]
    fn globs_with_several_double_stars() {
        let g = |p: &str| Glob::new(p).unwrap();
        for (pattern, event_type, expected) in [
            ("**.**", "a", true),
            ("**.b.**", "a.b.c", true),
            ("**.b.**", "a.c", false),
            ("a.**.**.z", "a.z", true),
            ("a.**.*.**.z", "a.z", false),
            ("a.**.*.**.z", "a.m.z", true),
            ("**.x.**.y", "x.y", true),
            ("**.x.**.y", "y.x", false),
        ] {
            assert_eq!(g(pattern).matches(event_type), expected, "{pattern} on {event_type}");
            let parts: Vec<&str> = event_type.split('.').collect();
            assert_eq!(matches_from(&g(pattern).segments, &parts), expected, "{pattern}");
        }
        let long = format!("{}a", "a.".repeat(127));
        let started = std::time::Instant::now();
        assert!(!g("**.**.**.**.**.x").matches(&long));
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "took {:?}",
            started.elapsed()
        );
    }
}
