//! Where webhooks may go, and how their URLs are shown.
//!
//! Webhooks reach public addresses only: every address a URL's host resolves to, whenever
//! the webhook client opens a connection ([`webhook_client`]'s resolver), and an address
//! given literally, at every delivery ([`check_target`]), is checked against private,
//! loopback, link-local, shared, documentation, benchmarking, multicast and reserved ranges
//! (and the IPv4 address inside mapped, translated, NAT64 and 6to4 IPv6 addresses). A name
//! that resolves to any address outside is refused whole, and the client connects only to
//! the addresses its resolver checked. [`SubscriptionLimits::webhook_allowed_networks`]
//! opens ranges on purpose (a consumer on the same machine, tests).
//!
//! A webhook URL may carry a secret (a token in its path or query string); [`redacted_url`]
//! (its origin only) is what anyone but the subscription's owner sees.
//!
//! [`SubscriptionLimits::webhook_allowed_networks`]: super::SubscriptionLimits

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// An IP network, `address/prefix` (a bare address is a network of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    address: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Network {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (address, prefix) = match text.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text.trim(), None),
        };
        let address: IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: the prefix must be 0 to {max}"))?,
            None => max,
        };
        Ok(Network { address, prefix })
    }
}

impl Network {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.address, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Whether an IPv4 address is on the public internet: not private, loopback, link-local,
/// shared (CGNAT), documentation, benchmarking, multicast, reserved or broadcast.
fn public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 168)
        || (a == 192 && b == 0 && (c == 0 || c == 2))
        || (a == 192 && b == 88 && c == 99)
        || (a == 198 && (b == 18 || b == 19))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        || a >= 224)
}

/// Whether an IPv6 address is on the public internet. Addresses that carry an IPv4 address
/// (mapped, compatible, NAT64, 6to4) are judged by it.
fn public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let embedded = |hi: usize| {
        Ipv4Addr::new(
            (s[hi] >> 8) as u8,
            s[hi] as u8,
            (s[hi + 1] >> 8) as u8,
            s[hi + 1] as u8,
        )
    };
    if s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) {
        // ::ffff:a.b.c.d (mapped), ::a.b.c.d (compatible), ::, ::1
        return public_v4(embedded(6)) && !(s[5] == 0 && s[6] == 0);
    }
    if s[..4] == [0; 4] && s[4] == 0xffff && s[5] == 0 {
        // ::ffff:0:a.b.c.d (IPv4-translated)
        return public_v4(embedded(6));
    }
    if s[0] == 0x64 && s[1] == 0xff9b {
        // NAT64: 64:ff9b::/96 carries the IPv4 address last; 64:ff9b:1::/48 (local use)
        // carries it where its operator chose, so it is refused whole.
        return s[2] != 1 && public_v4(embedded(6));
    }
    if s[0] == 0x2002 {
        // 6to4: the IPv4 address is in the next 32 bits.
        return public_v4(embedded(1));
    }
    !((s[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (s[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (s[0] & 0xffc0) == 0xfec0 // site-local fec0::/10
        || (s[0] & 0xff00) == 0xff00 // multicast
        || (s[0] == 0x2001 && s[1] < 0x0200) // protocol assignments, Teredo 2001::/23
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0])) // discard 100::/64
}

/// Whether a webhook may be sent to `ip`: a public address, or one in an allowed network.
pub(crate) fn address_allowed(ip: IpAddr, allowed: &[Network]) -> bool {
    if allowed.iter().any(|n| n.contains(ip)) {
        return true;
    }
    match ip {
        IpAddr::V4(v4) => public_v4(v4),
        IpAddr::V6(v6) => public_v6(v6),
    }
}

/// Longest webhook URL, in bytes.
pub(crate) const MAX_URL_BYTES: usize = 2048;

/// Whether `url` may be a webhook target: a plain http(s) URL of at most [`MAX_URL_BYTES`],
/// without user info, whose host, when it is an address, is one a webhook may reach. Names
/// are resolved and checked at each delivery.
pub(crate) fn url_allowed(url: &str, allowed: &[Network]) -> bool {
    if url.len() > MAX_URL_BYTES {
        return false;
    }
    let Ok(parsed) = url::Url::parse(url) else {
        return false;
    };
    if !matches!(parsed.scheme(), "http" | "https")
        || !parsed.username().is_empty()
        || parsed.password().is_some()
    {
        return false;
    }
    match parsed.host() {
        Some(url::Host::Ipv4(ip)) => address_allowed(IpAddr::V4(ip), allowed),
        Some(url::Host::Ipv6(ip)) => address_allowed(IpAddr::V6(ip), allowed),
        Some(url::Host::Domain(d)) => !d.is_empty(),
        None => false,
    }
}

/// Checks a delivery's URL before it is sent: http(s), and an address given literally one a
/// webhook may reach (the client connects to a literal address without resolving it; names
/// are checked by the client's resolver).
pub(crate) fn check_target(url: &url::Url, allowed: &[Network]) -> Result<(), String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{} is not a webhook scheme", url.scheme()));
    }
    let literal = match url.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
        Some(url::Host::Domain(_)) => return Ok(()),
        None => return Err("the webhook URL has no host".into()),
    };
    if address_allowed(literal, allowed) {
        Ok(())
    } else {
        Err(format!("{literal} is not an address webhooks may reach"))
    }
}

/// Resolves webhook hosts for the client, handing it only addresses webhooks may reach.
struct CheckedResolver {
    allowed: std::sync::Arc<[Network]>,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allowed = self.allowed.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addresses: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(bad) = addresses
                .iter()
                .find(|a| !address_allowed(a.ip(), &allowed))
            {
                return Err(format!(
                    "{host} resolves to {}, which webhooks may not reach",
                    bad.ip()
                )
                .into());
            }
            if addresses.is_empty() {
                return Err(format!("{host} has no address").into());
            }
            Ok(Box::new(addresses.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The one client webhooks are sent with: addresses checked by its resolver, a 10 s
/// deadline per request (answer included), no redirects, no proxy, a few idle connections
/// kept per host.
pub(crate) fn webhook_client(allowed: &[Network]) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .pool_max_idle_per_host(2)
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .dns_resolver(std::sync::Arc::new(CheckedResolver {
            allowed: allowed.into(),
        }))
        .build()
        .map_err(|e| format!("the webhook client: {e}"))
}

/// A webhook URL as anyone but its owner sees it: its origin only, `scheme://host[:port]`,
/// and `/…` where it had more (a path may hold secrets as a query may: Slack-style
/// `/services/T/B/SECRET`; user info, query and fragment go too). The second value says
/// whether anything was removed.
pub(crate) fn redacted_url(url: &str) -> (String, bool) {
    let Ok(parsed) = url::Url::parse(url) else {
        return (String::new(), !url.is_empty());
    };
    let origin = parsed.origin().ascii_serialization();
    let bare = parsed.path() == "/"
        && parsed.query().is_none()
        && parsed.fragment().is_none()
        && parsed.username().is_empty()
        && parsed.password().is_none();
    if bare && origin != "null" {
        return (format!("{origin}/"), false);
    }
    if origin == "null" {
        return (String::new(), true);
    }
    (format!("{origin}/…"), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webhook_targets() {
        let none: &[Network] = &[];
        assert!(url_allowed("https://example.com/hook", none));
        assert!(url_allowed("http://8.8.8.8/hook", none));
        assert!(!url_allowed("ftp://example.com/", none));
        assert!(!url_allowed("http://user:pw@example.com/", none));
        assert!(!url_allowed(
            &format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES)),
            none
        ));
        for url in [
            "http://127.0.0.1:9/hook",
            "http://10.0.0.1/hook",
            "http://192.168.1.2/hook",
            "http://172.16.0.1/",
            "http://100.64.0.1/",
            "http://169.254.169.254/latest/meta-data",
            "http://0.0.0.0/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:10.0.0.1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://[::ffff:0:127.0.0.1]/",
            "http://[64:ff9b:1::808:808]/",
            "http://[64:ff9b::a00:1]/",
            "http://[2002:a00:1::]/",
            "http://[fd00::1]/",
            "http://[fe80::1]/",
            "http://[ff02::1]/",
            "http://[::]/",
            "http://224.0.0.1/",
            "http://255.255.255.255/",
        ] {
            assert!(!url_allowed(url, none), "{url} is allowed");
        }
        let loopback: Vec<Network> = vec!["127.0.0.0/8".parse().unwrap()];
        assert!(url_allowed("http://127.0.0.1:9/hook", &loopback));
        assert!(!url_allowed("http://10.0.0.1/hook", &loopback));
        assert!("300.0.0.0/8".parse::<Network>().is_err());
        assert!("10.0.0.0/33".parse::<Network>().is_err());
    }

    #[test]
    fn secrets_are_taken_out_of_shown_urls() {
        assert_eq!(
            redacted_url("https://example.com/hook?token=s3cret#frag"),
            ("https://example.com/…".to_owned(), true)
        );
        // A secret in the path (Slack-style) is not shown either.
        assert_eq!(
            redacted_url("https://hooks.example.com:8443/services/T0/B0/s3cret"),
            ("https://hooks.example.com:8443/…".to_owned(), true)
        );
        assert_eq!(
            redacted_url("https://example.com/"),
            ("https://example.com/".to_owned(), false)
        );
        let (shown, redacted) = redacted_url("https://u:p@example.com/h?x=1");
        assert!(redacted);
        assert_eq!(shown, "https://example.com/…");
    }
}
